"""The benchmarks as one importable package: drivers and workers import their shared pieces as ``benchmarks.X``
and the example model as ``examples.gpt`` / ``examples.data``, with the checkout on the import path (no file here
edits ``sys.path``; tests/unit/test_benchmarks_imports.py checks it).

Run a driver from the repository root, either as a module or as a script with ``PYTHONPATH=.`` (what
benchmarks/run_gpu.sh and run_multi.sh export)::

    python -m benchmarks.peers --gpus 2 ...
    PYTHONPATH=. python benchmarks/peers.py --gpus 2 ...
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/moe.py ...

The shared pieces: ``benchmarks.peers`` (the runner: child processes, timeouts, retries, records),
``benchmarks.peers_worker`` (the GPT peer builders: strategies, where the model is built, the Trainer that only
trains, the rank record), ``benchmarks.timing`` (the step timer), ``benchmarks.records`` (what a worker writes;
failures become rows), ``benchmarks.comm_profile`` (``--profile``) over ``benchmarks.overlap``
(exposed-communication math), ``benchmarks.peers_report`` (records to tables) and ``benchmarks.presets`` (model
shapes, peer lists). Drivers (peers.py, lora.py, checkpoint.py, compile.py, fabric.py, tp.py, ...) parse
arguments and hand configurations to the runner; their ``*_worker.py`` build one configuration on top of
``peers_worker``. Children get the checkout on ``PYTHONPATH`` (``peers.child_env``).
"""
