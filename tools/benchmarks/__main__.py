"""`python -m tools.benchmarks`: the command line (see `cli.main`)."""

# Every part's module, so that its children are registered.
from tools.benchmarks import (  # noqa: F401
    build,
    cli,
    cores,
    defaults,
    fidelity,
    generation,
    inference,
    memory,
    overhead,
    peer,
    peer_torch,
    replicas,
    throughput,
)

if __name__ == "__main__":
    cli.main()
