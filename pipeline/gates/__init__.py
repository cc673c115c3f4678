"""The gates: region probe, correctness, performance, their statistics, reports and promotion;
the benchmarks over an open pipeline.

Each gate's whole run is a library function over open pipelines. The gate knobs' defaults live
in `settings.py` (GateSettings, CorrectnessSettings, PerfSettings), once; specs fill in from them.
Importing this package loads no torch."""
from pipeline.gates.settings import CorrectnessSettings, GateSettings, PerfSettings  # noqa: F401
