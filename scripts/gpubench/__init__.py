"""The GPU session's measurements, one job per module (run as ``python -m gpubench`` with scripts/ on
sys.path; every module imports its siblings as ``gpubench.<module>``):

* ``timing``: warm-ups, then batches of back-to-back calls blocked once, median of the batches.
* ``ceilings``: what this card measures for a large bf16 matmul and a device-to-device copy.
* ``attention``: the per-device attention shapes x backends, judged for correctness before timing.
* ``step``: one FLUX-dev 1024x1024 denoising step with random bf16 weights per backend.
* ``report``: the one JSON and the table.
* ``__main__``: the order, the time budget and the dry run (``GPU_SESSION_DRY_RUN=1``: tiny shapes, CPU).
"""
