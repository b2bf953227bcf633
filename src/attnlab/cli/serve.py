"""`attnlab serve`: the live explainer in the browser (a local web app)."""

from __future__ import annotations

from asyncio import CancelledError
from pathlib import Path
from typing import Annotated, Any

import typer

from attnlab.cli.app import app
from attnlab.cli.output import UserError, output


@app.command()
def serve(
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="A model to offer (repeatable): example:journey, example:toy, a packaged "
            "name (smollm2-135m-instruct, gemma3-270m, all-minilm-l6-v2), a checkpoint "
            "folder, a model directory or .gguf file, or a store name (org/name[@revision], "
            "ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE]). Default: the seed's "
            "example, runs/gpt if it exists, the packaged models installed, and every "
            "loadable model `attnlab models` finds.",
        ),
    ] = None,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on. Anything but 127.0.0.1/localhost/::1 lets "
            "other machines in: give it explicitly."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).")] = 8765,
    workers: Annotated[int, typer.Option(help="Threads running model work.")] = 2,
    queue: Annotated[
        int, typer.Option(help="Requests that may wait for a worker; beyond: 429.")
    ] = 16,
    max_loaded: Annotated[
        int, typer.Option("--max-loaded", help="Models kept in memory (LRU).")
    ] = 2,
    max_chars: Annotated[int, typer.Option("--max-chars", help="Characters of text.")] = 20_000,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens of text (and the model's context).")
    ] = 1024,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens one generation may produce.")
    ] = 256,
    max_top_k: Annotated[int, typer.Option("--max-top-k", help="Largest top_k.")] = 100,
    lang: Annotated[str, typer.Option("--lang", "-l", help="Page language: en or zh-TW.")] = "en",
) -> None:
    """Serve the live explainer: type text, see every head, step into one, generate."""
    try:
        from attnlab.serve import (
            ModelRegistry,
            ServeLimits,
            WorkerPool,
            create_app,
            default_specs,
            is_loopback,
            spec_for,
        )
        from attnlab.serve import serve as run_server
    except ImportError as e:
        raise UserError(
            f"attnlab serve needs the serve extra ({e.name} is missing): "
            "pip install 'attnlab[serve]'"
        ) from e
    from attnlab.explain.i18n import LANGS, normalize_lang
    from attnlab.pretrained import MissingPackageError

    try:
        lang = normalize_lang(lang)
    except ValueError:
        raise UserError(f"unknown --lang {lang!r}; choose one of {', '.join(LANGS)}") from None
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be a TCP port in 0..65535 (0: any free port), got {port}")
    try:
        specs = [spec_for(m) for m in model] if model else default_specs(Path("runs/gpt"))
        limits = ServeLimits(
            max_chars=max_chars,
            max_tokens=max_tokens,
            max_new_tokens=max_new_tokens,
            max_top_k=max_top_k,
        )
        pool = WorkerPool(workers=workers, queue=queue)

        def progress(event: str, name: str, detail: Any) -> None:
            if event == "loading":
                output.note(f"loading {name} ...")
            elif event == "ready":
                output.note(f"{name} ready ({detail:.1f} s)")
            else:
                output.note(f"{name} failed to load: {detail}")

        registry = ModelRegistry(specs, max_loaded=max_loaded, on_event=progress)
        application = create_app(registry, limits=limits, pool=pool, lang=lang)
    except MissingPackageError as e:  # a --model whose weights or reader is not installed
        raise UserError(str(e)) from e
    except ValueError as e:  # a ModelFileError too: one line, the file named
        raise UserError(
            str(e)
            .replace("`max_", "`--max-")
            .replace("`workers`", "`--workers`")
            .replace("`queue`", "`--queue`")
        ) from e

    def started(url: str) -> None:
        line = f"attnlab serving on {url}"
        if not is_loopback(host):
            line += f" (listening on {host}: other machines can reach it)"
        output.console.print(line, markup=False, soft_wrap=True)
        output.note(f"models: {', '.join(registry.names)}; Ctrl-C stops")

    try:
        run_server(application, host=host, port=port, on_start=started)
    except (KeyboardInterrupt, CancelledError):  # Ctrl-C is how a server is stopped
        # (CancelledError: Python 3.11's asyncio.Runner can lose its count of a SIGINT
        # that lands while it installs its handler, and re-raise the cancellation.)
        pass
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    # uvicorn re-raises the signal it stopped on through the handler it found at start:
    # KeyboardInterrupt by default, nothing when SIGINT was ignored; stopped either way.
    output.note("stopped")
