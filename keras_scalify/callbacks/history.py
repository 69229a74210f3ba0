"""The history files of `ScaleMonitor(log_dir=...)`: their names, the
CSV and JSON writers, and `load_history`, which reads the CSV back."""

import csv
import os

import numpy as np

HISTORY_FILE = "scale_monitor.csv"
TRACE_FILE = "scale_monitor_steps.csv"
JSON_FILE = "scale_monitor.json"


def _json_list(a):
    return [None if not np.isfinite(v) else float(v) for v in a]


def _write_csv(path, columns):
    keys = list(columns)
    n = len(next(iter(columns.values()))) if columns else 0
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for i in range(n):
            w.writerow([repr(float(columns[k][i])) for k in keys])


def load_history(log_dir):
    """`(history, trace)` as dicts of NumPy arrays, read back from the CSV
    files a `ScaleMonitor(log_dir=...)` wrote."""

    def read(path):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            return {}
        keys, body = rows[0], rows[1:]
        return {
            k: np.asarray([float(r[i]) for r in body], np.float64)
            for i, k in enumerate(keys)
        }

    history = read(os.path.join(log_dir, HISTORY_FILE))
    trace_path = os.path.join(log_dir, TRACE_FILE)
    trace = read(trace_path) if os.path.exists(trace_path) else None
    return history, trace
