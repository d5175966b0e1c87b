"""The gateway measured with NVIDIA's ``aiperf``: ``python -m bench.aiperf`` (see ``__main__``).

Short form (``make bench-smoke``; a few tens of seconds once aiperf is installed)::

    python -m bench.aiperf --policies prefix_aware --rates 8 --conversations 4 --turns 2 --replicas 2

It writes ``aiperf_gateway.json`` under ``bench.common.results_dir()`` (``$BENCH_RESULTS_DIR``). The first
run on a machine also installs aiperf into its own cached virtualenv (``bench.aiperf.install``: minutes).
"""
