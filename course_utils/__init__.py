"""Shared code for the course "Cheaper LLM inference, measured".

PyTorch's CPU worker threads (OpenMP) wait for the next parallel region by spinning a while, then
sleeping. The course leaves that to the OpenMP runtime's own default, and every speed figure it
prints names the setting in force (:func:`course_utils.measure.openmp_wait_policy`). Forcing the
threads to sleep at once (``OMP_WAIT_POLICY=PASSIVE``, set before ``torch`` is imported) makes every
parallel region pay a wake-up: on the 2-core development machine (AVX2) it made the embedded model's
bfloat16 matrix products 1.5-3x slower on a quiet machine, and 10-25 % faster when a second process
competed for both cores. Set it yourself before starting Jupyter if your machine is shared.
"""

__version__ = "0.1.0"
