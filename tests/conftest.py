"""Shared test set-up: one thread per process keeps timings and numerics predictable on CPU."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
