"""Import cost of the package against its dependencies (the target: within 0.5 s of ``import torch, transformers,
accelerate``). Each measurement is a fresh interpreter that imports the baseline modules, then the package, timing
each part with the process CPU clock (``time.process_time``; imports are CPU-bound once the files are cached) and the
wall clock; rounds alternate nothing else, the median over rounds is printed with its min-max.

    python benchmarks/bench_import.py [--rounds 7]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generation import header_line  # noqa: E402

CHILD = """
import json, time
start_cpu, start_wall = time.process_time(), time.perf_counter()
import torch, transformers, accelerate
base_cpu, base_wall = time.process_time(), time.perf_counter()
import hf_structattn
end_cpu, end_wall = time.process_time(), time.perf_counter()
from transformers import AutoConfig
AutoConfig.for_model("structattn_gpt2")
config_cpu, config_wall = time.process_time(), time.perf_counter()
print(json.dumps({"base_cpu": base_cpu - start_cpu, "base_wall": base_wall - start_wall,
                  "package_cpu": end_cpu - base_cpu, "package_wall": end_wall - base_wall,
                  "config_cpu": config_cpu - end_cpu, "config_wall": config_wall - end_wall}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(args.rounds + 1):  # the first run warms the file cache and is dropped
        result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=root,
                                timeout=300, check=True)
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    runs = runs[1:]
    print(header_line(f"fresh interpreter per round, {args.rounds} rounds, median [min-max]"))
    print()
    print("| import | CPU s | wall s |")
    print("|---|---:|---:|")
    for label, key in (("torch, transformers, accelerate", "base"), ("then `import hf_structattn`", "package"),
                       ("then the first GPT-2 family config (registers the model classes: imports transformers' "
                        "modeling code and ours)", "config")):
        cpu = [run[f"{key}_cpu"] for run in runs]
        wall = [run[f"{key}_wall"] for run in runs]
        print(f"| {label} | {statistics.median(cpu):.2f} [{min(cpu):.2f}-{max(cpu):.2f}] | "
              f"{statistics.median(wall):.2f} [{min(wall):.2f}-{max(wall):.2f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
