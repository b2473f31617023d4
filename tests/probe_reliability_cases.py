"""Probe the refusals of issue 33 that need no devices: each bad input is tried against the code's own
checks and classified as clear (refused, naming the token), unhelpful (refused without naming it), raw
(another exception), silent (accepted) or hang (no answer within the limit).

    .venv/bin/python -m tests.probe_reliability_cases
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def serve_check(*flags: str):
    from jaxdit.serve import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.check(parser.parse_args(["--emulate_devices", "1", *flags]))


def generate_check(**fields):
    from jaxdit.generate_checks import check_request
    from jaxdit.generate_request import GenerateRequest

    check_request(GenerateRequest(**fields))


def generate_run_check(**fields):
    """What `jaxdit generate` checks beyond check_request (flags that would change nothing)."""
    from jaxdit.generate_checks import check_request, check_run
    from jaxdit.generate_request import GenerateRequest

    request = GenerateRequest(**fields)
    check_request(request)
    check_run(request)


def flux_config(**fields):
    """A diffusers FluxTransformer2DModel config.json with absurd fields, read as generate, convert and
    serve read it."""
    from jaxdit.models.flux import FluxConfig

    base = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=32, pooled_projection_dim=32, in_channels=16, axes_dims_rope=[4, 6, 6])  # fmt: skip
    return FluxConfig.from_diffusers({**base, **fields})


def plan(*flags: str):
    from jaxdit.plan import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(flags)))


def seconds(value):
    from jaxdit.serve.schema import RequestError, _seconds

    try:
        frames = int(_seconds(value) * 16)  # as a card turns seconds into frames
    except RequestError as e:
        raise ValueError(e.message) from None
    return frames


def route(method: str, path: str):
    """The status and body of one ASGI call against the app over a stub scheduler."""
    from jaxdit.serve.app import create_app

    class Stub:
        class engine:  # noqa: N801
            card = type("Card", (), {"kind": "image", "name": "stub"})()

        metrics = None

    app = create_app(Stub())
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": ""}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        error = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"plain {body[:40]!r}"
    raise ValueError(error)


def busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def cases():
    holder, port = busy_port()
    yield "serve --request_timeout nan", "request_timeout", lambda: serve_check("--request_timeout", "nan")
    yield "serve --request_timeout inf", "request_timeout", lambda: serve_check("--request_timeout", "inf")
    yield (
        "serve --initialization_timeout nan",
        "initialization_timeout",
        lambda: serve_check("--initialization_timeout", "nan"),
    )
    yield (
        "serve --initialization_timeout inf",
        "initialization_timeout",
        lambda: serve_check("--initialization_timeout", "inf"),
    )
    yield "serve --shutdown_grace nan", "shutdown_grace", lambda: serve_check("--shutdown_grace", "nan")
    yield "serve --shutdown_grace -1", "shutdown_grace", lambda: serve_check("--shutdown_grace", "-1")
    yield "serve --max_queue -1", "max_queue", lambda: serve_check("--max_queue", "-1")
    yield "serve --host 999.1.1.1", "999.1.1.1", lambda: serve_check("--host", "999.1.1.1")
    yield "serve --port in use", str(port), lambda: serve_check("--port", str(port))
    yield "serve --port 70000", "port", lambda: serve_check("--port", "70000")
    yield "generate --output ''", "--output", lambda: generate_check(output="")
    yield "generate --output '  '", "--output", lambda: generate_check(output="  ")
    yield (
        "generate --initialization_timeout nan",
        "initialization_timeout",
        lambda: generate_check(initialization_timeout=float("nan")),
    )
    yield (
        "generate --negative_prompt 3 --true_cfg_scale 1",
        "--negative_prompt",
        lambda: generate_run_check(negative_prompt="3", true_cfg_scale=1.0),
    )
    yield "config patch_size -3", "patch_size", lambda: flux_config(patch_size=-3)
    yield "config num_layers 1000000", "num_layers", lambda: flux_config(num_layers=1000000)
    yield (
        "plan --configs without --verify",
        "--verify",
        lambda: plan("--model", "flux-dev", "--devices", "8", "--configs", "ulysses8"),
    )
    yield 'video "seconds": "1e308"', "seconds", lambda: seconds("1e308")
    yield 'video "seconds": 1e300', "seconds", lambda: seconds(1e300)
    yield 'video "seconds": "nan"', "seconds", lambda: seconds("nan")
    yield "GET /nowhere", "/nowhere", lambda: route("GET", "/nowhere")
    yield "DELETE /healthz", "/healthz", lambda: route("DELETE", "/healthz")
    yield (
        "PUT /v1/images/generations",
        "/v1/images/generations",
        lambda: route("PUT", "/v1/images/generations"),
    )
    yield (
        "GET /v1/images/generations",
        "/v1/images/generations",
        lambda: route("GET", "/v1/images/generations"),
    )
    holder.close()


def classify(token: str, attempt) -> tuple[str, str]:
    try:
        result = attempt()
    except ValueError as e:
        return ("clear" if token in str(e) else "unhelpful"), str(e).splitlines()[0][:110]
    except SystemExit as e:
        return "unhelpful", f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 (the probe's point: what escapes)
        return "raw", f"{type(e).__name__}: {str(e)[:100]}"
    if isinstance(result, str) and result.startswith("plain"):
        return "unhelpful", f"answered {result}"  # refused, but not in the service's JSON error shape
    return "silent", f"accepted: {str(result)[:100]}"


def probe() -> dict[str, tuple[str, str]]:
    """{input: (class, first line of the answer)} for every case."""
    return {name: classify(token, attempt) for name, token, attempt in cases()}


def main() -> int:
    counts = Counter()
    for name, (kind, detail) in probe().items():
        counts[kind] += 1
        print(f"{kind:9s} {name:40s} {detail}")
    total = sum(counts.values())
    print(
        f"{total} inputs: " + ", ".join(f"{counts[k]} {k}" for k in ("clear", "unhelpful", "raw", "silent"))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
