"""The gates: region probe, correctness, performance, their statistics, reports and promotion.

Each gate's whole run is a library function over open pipelines. The gate knobs' defaults live
here, once (specs fill in from them); importing this module loads no torch."""

# probe_seed None: drawn per run and recorded, so a kernel cannot count the probe's calls
CORRECTNESS_DEFAULTS = {"max_abs_diff": 0.02, "min_cosine": 0.999, "probe_seed": None}
# trials is the cap: the sequential rule stops at min_trials + k * check_every once the verdict is clear
PERF_DEFAULTS = {"trials": 30, "warmup": 3, "threshold": 0.98, "seed": 0, "resamples": 2000,
                 "confidence": 0.95, "min_trials": 20, "check_every": 10}
