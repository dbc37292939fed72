"""Shared code for the course "Cheaper LLM inference, measured".

Importing this package before ``torch`` lets idle PyTorch worker threads sleep instead of
spinning (``OMP_WAIT_POLICY=PASSIVE``, unless you set it yourself). On a busy machine —
a laptop running a browser, a shared Binder host, a test runner — spinning threads can
slow every small operation down tenfold; on an idle machine the setting costs a little
latency on short operations. Set ``OMP_WAIT_POLICY=ACTIVE`` before starting Jupyter to
measure an idle machine's best case.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
