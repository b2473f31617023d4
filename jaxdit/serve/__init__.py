"""``jaxdit serve``: a long-running HTTP service that keeps one model loaded and compiled on its mesh.

The parts, each in its own module:

- :mod:`jaxdit.serve.schema`: the HTTP requests' fields, checked against the served model's card
  (OpenAI's image and video request shapes plus the diffusion fields); needs no devices.
- :mod:`jaxdit.serve.engine`: the only module that calls the pipelines: loads the model, compiles the
  served shapes at start-up, runs one generation with a per-step callback, encodes PNG / MP4.
- :mod:`jaxdit.serve.jobs`: the bounded queue, the device worker, cancellation, timeouts, shutdown.
- :mod:`jaxdit.serve.lockstep`: across processes, process 0 hands every request (and every step's
  go/stop) to the others through the coordination service's key-value store.
- :mod:`jaxdit.serve.metrics`: Prometheus metrics, the compile counter.
- :mod:`jaxdit.serve.app`: the Starlette application (routes, errors, client disconnects).
- :mod:`jaxdit.serve.command`: the ``jaxdit serve`` command: start-up, uvicorn, graceful shutdown.

The HTTP framework (Starlette, uvicorn, prometheus_client) is the optional ``serve`` extra:
``pip install 'jaxdit[serve]'``; nothing else in jaxdit imports this package.
"""
