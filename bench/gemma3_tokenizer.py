"""Time to build the real Gemma 3 tokenizer (262,144 tokens) from its file, in a process where
torch cannot be imported, with an empty rljax cache; then the second build, from the cache.

tests/test_gemma.py checks that the build works without torch and gives transformers' ids; the
time it takes is measured here and recorded in bench/RESULTS.md.

    python bench/gemma3_tokenizer.py [--runs 3] [--out bench/results/gemma3_tokenizer.json]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

CODE = """import sys, json, time, resource
sys.modules['torch'] = None  # as if not installed
from rljax import models, tokenizers
path = models.gemma3_270m_path()
out = []
for _ in range(2):  # cold (empty cache), then from the cache
    wall, cpu = time.perf_counter(), time.process_time()
    tokenizers.load(path)
    out.append([time.perf_counter() - wall, time.process_time() - cpu])
print(json.dumps(out))
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, RLJAX_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                                 env=env, check=True)
            (cold, cold_cpu), (warm, warm_cpu) = json.loads(out.stdout.splitlines()[-1])
            runs.append(dict(cold_s=round(cold, 2), cold_cpu_s=round(cold_cpu, 2),
                             cached_s=round(warm, 3), cached_cpu_s=round(warm_cpu, 3),
                             load_before=round(load, 2)))
            print(runs[-1], flush=True)
    cold = sorted(r["cold_s"] for r in runs)[len(runs) // 2]
    result = dict(cpu=cpu_model(), cores=os.cpu_count(), runs=runs, cold_s_median=cold)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
