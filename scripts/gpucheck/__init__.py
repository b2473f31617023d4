"""scripts/gpu_check.py's parts, one job each (imported as ``gpucheck.<module>`` with scripts/ on
sys.path): ``cases`` (the attention shapes and row keys), ``results`` (the JSON written after every row),
``report`` (the table and the targets)."""
