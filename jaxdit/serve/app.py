"""The HTTP application (Starlette): OpenAI-shaped routes over a :class:`~jaxdit.serve.jobs.Scheduler`.

=======================================  ==================================================================
``POST /v1/images/generations``          images; answered when done: ``{"created", "data": [{"b64_json"}]}``
``POST /v1/videos``                      a video job; answered at once with the job (``id``, ``status``)
``GET /v1/videos/{id}``                  the job: status (queued, in_progress, completed, failed,
                                         cancelled) and progress (``steps_done`` of ``steps_total``)
``GET /v1/videos/{id}/content``          the MP4 once completed
``DELETE /v1/videos/{id}``               cancel (stops after the current step) or forget a finished job
``GET /healthz``                         200 while serving (model, shapes, queue), 503 while shutting down
                                         or when a follower process has stopped answering
``GET /metrics``                         Prometheus text (:mod:`jaxdit.serve.metrics`)
=======================================  ==================================================================

Errors come back in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field, 404 unknown job or route, 405 wrong method, 408 body not sent in time, 409 content not ready, 413
body too large, 415 not JSON, 429 queue full (with ``Retry-After``), 500 the generation failed, 503 shutting down, 504 timed out. A client that disconnects
while its image is being made stops the generation after the current step.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxdit.serve import schema
from jaxdit.serve.jobs import COMPLETED, QueueFull, Scheduler, ShapeNotServed, ShuttingDown
from jaxdit.serve.metrics import CONTENT_TYPE
from jaxdit.serve.schema import RequestError

__all__ = ["create_app"]

#: The largest request body read when the card gives none (a prompt of a few thousand characters is a
#: few KiB; a model that takes pictures has its card's ``max_body_bytes``, ``jaxdit serve --max_body_bytes``).
MAX_BODY_BYTES = 1 << 20
#: A body over the limit but under this is read and discarded before the 413, so that the client, still
#: sending, reads the answer instead of a connection reset; a larger one is answered at once.
DRAIN_BYTES = 64 << 20
#: Seconds a client may take to send its whole body. The request timeout starts once the body is read,
#: so without this bound a body trickled byte by byte, or shorter than its Content-Length, would hold a
#: connection (and a worker) for ever.
BODY_TIMEOUT_S = 30.0


def _error(e: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _read_json(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        if int(size) <= DRAIN_BYTES:
            async for _ in request.stream():
                pass
        raise RequestError(f"the body is {size} bytes; the limit is {limit}", "body", status=413)
    chunks, length = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        length += len(chunk)
        if length > limit:
            raise RequestError(f"the body exceeds {limit} bytes", "body", status=413)
    return schema.parse_json(b"".join(chunks), request.headers.get("content-type"))


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_body_in_time(request: Request, seconds: float, limit: int) -> dict[str, Any]:
    try:
        return await asyncio.wait_for(_read_json(request, limit), seconds)
    except TimeoutError:
        raise RequestError(
            f"the body did not arrive within {seconds:g} s (all of its Content-Length)", "body", status=408
        ) from None


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown routes and wrong methods, in the same error shape as every other answer."""
    messages = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}",
    }
    error = RequestError(messages.get(exc.status_code, str(exc.detail)), None, exc.status_code)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def create_app(scheduler: Scheduler, *, body_timeout: float = BODY_TIMEOUT_S) -> Starlette:
    """The application over ``scheduler`` (whose owner starts and closes it: :mod:`jaxdit.serve.command`).
    ``body_timeout``: seconds a client may take to send its body (then 408 and the connection closes)."""
    card, metrics = scheduler.engine.card, scheduler.metrics

    async def submit(request: Request, parse) -> Any:
        """Read, check and queue a request: the job, or the error response (nothing reached the devices)."""
        kind = card.kind
        try:
            g = parse(await _read_body_in_time(request, body_timeout, card.max_body_bytes), card)
            scheduler.check(g)
            return scheduler.submit(g)
        except RequestError as e:
            metrics.outcome(
                kind, "rejected_shape" if isinstance(e, ShapeNotServed) else "rejected_bad_request"
            )
            # A body that never arrived whole leaves the connection in an unknown state: close it.
            return _error(e, {"Connection": "close"} if e.status == 408 else None)
        except QueueFull as e:
            metrics.outcome(kind, "rejected_queue_full")
            error = RequestError(str(e), None, 429, "rate_limit_error")
            return _error(error, {"Retry-After": str(e.retry_after)})
        except ShuttingDown as e:
            metrics.outcome(kind, "shutdown")
            return _error(RequestError(str(e), None, 503, "server_error"))

    async def images(request: Request) -> Response:
        job = await submit(request, schema.image_request)
        if isinstance(job, Response):
            return job
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        job.add_done_callback(lambda: loop.call_soon_threadsafe(_settle, finished))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        remaining = max(0.0, job.deadline - time.monotonic())
        done, _ = await asyncio.wait({finished, gone}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if gone in done and not job.done:
            scheduler.stop(job, "disconnected")
        elif not done:
            scheduler.stop(job, "timeout")
        gone.cancel()
        await finished  # a stopped job ends within one step
        if job.status != COMPLETED:
            return _error(job.error)
        data = [{"b64_json": base64.b64encode(f).decode("ascii")} for f in job.output.files]
        return JSONResponse({"created": job.created, "data": data})

    async def create_video(request: Request) -> Response:
        job = await submit(request, schema.video_request)
        return job if isinstance(job, Response) else JSONResponse(job.view())

    def lookup(request: Request):
        job = scheduler.get(request.path_params["video_id"])
        if job is None or job.kind != "video":
            raise RequestError(f"no video job {request.path_params['video_id']!r}", "video_id", status=404)
        return job

    async def video_status(request: Request) -> Response:
        try:
            return JSONResponse(lookup(request).view())
        except RequestError as e:
            return _error(e)

    async def video_content(request: Request) -> Response:
        try:
            job = lookup(request)
        except RequestError as e:
            return _error(e)
        if job.status != COMPLETED:
            detail = (
                f" ({job.steps_done} of {job.generation.steps} steps)" if job.status == "in_progress" else ""
            )
            return _error(RequestError(f"video {job.id} is {job.status}{detail}", "video_id", status=409))
        return Response(job.output.files[0], media_type=job.output.media_type)

    async def delete_video(request: Request) -> Response:
        try:
            job = lookup(request)
        except RequestError as e:
            return _error(e)
        if job.done:
            scheduler.forget(job.id)
            return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})
        scheduler.stop(job, "cancelled")
        return JSONResponse(job.view())

    async def healthz(request: Request) -> Response:
        lost = scheduler.lost_processes()
        closing = scheduler.closing or bool(lost)
        status = "shutting_down" if scheduler.closing else "process_lost" if lost else "ok"
        body = {
            "status": status,
            "lost_processes": lost,
            "model": card.name,
            "kind": card.kind,
            "shapes": [scheduler.engine.describe(k) for k in sorted(scheduler.engine.compiled)],
            "queue_depth": scheduler.queue_depth,
            "processes": scheduler.engine.num_processes,
            "devices": scheduler.engine.parallel.num_devices,
        }
        return JSONResponse(body, status_code=503 if closing else 200)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.text(), headers={"Content-Type": CONTENT_TYPE})

    routes = [
        Route("/v1/images/generations", images, methods=["POST"]),
        Route("/v1/videos", create_video, methods=["POST"]),
        Route("/v1/videos/{video_id}", video_status, methods=["GET"]),
        Route("/v1/videos/{video_id}", delete_video, methods=["DELETE"]),
        Route("/v1/videos/{video_id}/content", video_content, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
