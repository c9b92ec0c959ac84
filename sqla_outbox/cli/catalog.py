"""``python -m sqla_outbox catalog write``: tasks.json from the registered handlers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from sqla_outbox import errors
from sqla_outbox.cli.options import EXIT_CHECK_FAILED, handle_errors, load_settings, setting, split_list
from sqla_outbox.cli.terminal import echo


@click.group("catalog")
def catalog_group() -> None:
    """The task catalog (tasks.json) the API side reads."""


@catalog_group.command("write")
@setting("worker_imports", "--imports", "-I", callback=lambda ctx, param, value: split_list(value))
@setting("catalog_path", "--output", "-o")
@click.option("--check", is_flag=True, help="Exit 1 if the file on disk differs (for CI).")
def catalog_write_command(check: bool, **options: Any) -> None:
    """Write tasks.json from the @task registrations in --imports modules."""
    with handle_errors(False):
        settings = load_settings(**options)
        from sqla_outbox.maintenance import BUILTIN_TASKS
        from sqla_outbox.worker.consumer import import_task_modules
        from sqla_outbox.worker.registry import registry

        import_task_modules(settings.worker_imports)
        if not set(registry.tasks) - set(BUILTIN_TASKS):
            raise errors.ConfigurationError(
                "no tasks registered; pass the modules that define them with --imports",
                option="SQLA_OUTBOX_WORKER_IMPORTS",
            )
        text = registry.catalog().to_json()
        path = Path(settings.catalog_path)
        own = len(set(registry.tasks) - set(BUILTIN_TASKS))
        counted = f"{own} task{'' if own == 1 else 's'}, and {len(registry.tasks) - own} built in"
        rewrite = "python -m sqla_outbox catalog write" + "".join(
            f" --imports {module}" for module in settings.worker_imports
        )
        if check:
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != text:
                import difflib

                diff = difflib.unified_diff(
                    current.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"{path} (on disk)",
                    tofile=f"{path} (from the registered tasks)",
                )
                echo("".join(diff), nl=False)
                echo(f"error: {path} is stale; run `{rewrite}`", err=True)
                sys.exit(EXIT_CHECK_FAILED)
            echo(f"{path} is up to date ({counted})")
            return
        path.write_text(text, encoding="utf-8")
        echo(f"wrote {path} ({counted})")
