"""The "Faults survived" table of docs/reliability.md, measured.

    python tools/faults_survived.py                  # 2 runs of each fault
    python tools/faults_survived.py --repeats 3 --out faults.json

Runs `tests/support/recovery_scenarios.py` once per fault and repeat, each
in a client process of its own with two `local_workers(restart=True)`: an
MLP with Dropout on both stages, SGD with momentum, 2 epochs of 12 batches,
`keras_pipe.BackupAndRestore(save_freq=5)`; the fault comes before global
step 8 (or in the backup's save after step 10). Each run also trains the
same fit without a fault, on the same workers, as the reference. Prints a
markdown table (one row per fault, the range over the repeats) and, with
`--out`, every run's JSON.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIO = os.path.join(ROOT, "tests", "support", "recovery_scenarios.py")
FAULTS = [
    ("SIGKILL of worker 1 mid-epoch", "kill", 1,
     "2 refused probes (1 s apart), or TF's own error"),
    ("SIGKILL of worker 0 mid-epoch", "kill", 0,
     "2 refused probes (1 s apart), or TF's own error"),
    ("SIGKILL of worker 1 during a backup's save", "save", 1,
     "the save's read fails; the task refuses probes"),
    ("SIGSTOP of worker 1 mid-epoch (hung)", "stop", 1,
     "no probe answer for the step deadline (>= 10 s), then 5 s of grace"),
    ("SIGKILL of worker 1 kept up by a shell loop (not started by the "
     "client)", "remote", 1, "2 refused probes, or TF's own error"),
]


def run(scenario, task):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, SCENARIO, scenario, "--task",
                          str(task)], env=env, capture_output=True,
                         text=True, timeout=1800, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def span(values, fmt="{:.1f}"):
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows, runs = [], []
    for name, scenario, task, detection in FAULTS:
        results = [run(scenario, task) for _ in range(args.repeats)]
        runs.append({"fault": name, "runs": results})
        failed = [r["error"] for r in results if r["error"]]
        if failed:
            raise RuntimeError(f"{name}: {failed}")
        first = [r["recoveries"][0] for r in results]
        rows.append("| " + " | ".join([
            name, detection,
            span([f["detected_after_s"] for f in first]),
            span([f["recovery_s"] for f in first]),
            span([r["first_step_after_fault_s"] for r in results]),
            span([r["steps_begun"] - r["steps"] for r in results], "{:d}"),
            span([r["weights_max_diff"] for r in results], "{:.1g}"),
        ]) + " |")
    print("| fault | detected by | call ended after (s) | worker back, "
          "connected, re-placed (s) | first step after the fault (s) | "
          "steps run twice | final weights vs. no fault (max abs diff) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
