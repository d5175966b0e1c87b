"""Routing benchmark: round_robin, least_outstanding, session_affinity and prefix_aware on a shopper trace.

One module per concern, each importing only those before it: ``consts``, ``fleet`` (the simulated
cluster), ``stats`` (what a replay measured), ``replay``, ``report`` (tables, JSON), ``plots``,
``scenarios`` (the setups and stress shapes), ``cli``.

Setups:
  sim    8 simulated trtllm-serve replicas (qwen2.5-32b H100 cost model), subprocesses, Poisson arrivals
         at several utilisations of the cache-oblivious capacity (measured on the simulator's engine).
  kill   the same at one utilisation with prefix_aware, one replica SIGKILLed halfway: lost requests and
         recovery.
  llama  3 llama-server replicas with Gemma 3 270M on this CPU: measured prompt-cache reuse vs the oracle.
  scenarios  stress shapes (skewed shoppers, on/off bursts, long sessions, eviction pressure, a cache
         reset), each against the baselines; ``--repeats N`` replays each N times with new arrival
         times and judges the targets on the pooled server-side TTFTs (p99 with a bootstrap interval).

Usage:
  .venv/bin/python -m bench.routing                      # everything (about 15 minutes on 2 cores)
  .venv/bin/python -m bench.routing --quick              # smoke run (about 2 minutes): routing_quick*
  .venv/bin/python -m bench.routing --setups sim --utilisations 0.7
  .venv/bin/python -m bench.routing --setups scenarios --shoppers 80 --time-scale 0.75 --repeats 2
  .venv/bin/python -m bench.routing --engine-options '{"enable_chunked_prefill": true}' ...  # replica flags
  .venv/bin/python -m bench.routing --combine a.json,b.json --tag _all   # pool separate scenario runs

Prints tables and the machine; writes bench/results/routing*.json and routing.png / routing_kill.png.
Times are reported in *simulated* milliseconds (wall / time scale) for the simulator.
"""
