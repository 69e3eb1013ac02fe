"""Code the tests share: helpers, scenario scripts run in subprocesses, snippets."""
