"""The distributed runtime: TF workers, the cluster client, diagnosis.

Starts loopback-only TF workers (`worker`, `bind` and its shim), connects a
client to them (`cluster`) and names the task behind a remote error
(`diagnosis`). May import `keras_pipe.engine`.
Internal: users call `keras_pipe.connect` and run
`python -m keras_pipe.distributed.worker`.
"""
