"""Shared test settings: small thread counts keep many gloo ranks workable on 2 cores."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
