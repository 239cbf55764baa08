"""The CLI reference as Markdown, generated from the click command tree (used by the docs build)."""

from __future__ import annotations

import inspect

import click


def render_reference(group: click.Command, prog: str = "slurm-elastic") -> str:
    """Every command's usage, help text and options, depth first."""
    lines: list[str] = []
    _render(group, prog, click.Context(group, info_name=prog), lines, level=2)
    return "\n".join(lines) + "\n"


def _render(cmd: click.Command, path: str, ctx: click.Context, lines: list[str], level: int) -> None:
    lines.append(f"{'#' * level} `{path}`")
    lines.append("")
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    lines.append("```text")
    lines.append(f"Usage: {path} {usage}".rstrip())
    lines.append("```")
    lines.append("")
    if cmd.help:
        lines.append("```text")
        text = inspect.cleandoc(click.unstyle(cmd.help))
        lines.append("\n".join(line for line in text.splitlines() if line.strip() != "\b"))
        lines.append("```")
        lines.append("")
    opts = [p for p in cmd.get_params(ctx) if isinstance(p, click.Option)]
    if opts:
        lines.append("| option | meaning |")
        lines.append("|---|---|")
        for opt in opts:
            record = opt.get_help_record(ctx)
            if record is None:
                continue
            names, text = record
            escaped = text.replace("|", "\\|")
            lines.append(f"| `{names}` | {escaped} |")
        lines.append("")
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            _render(sub, f"{path} {name}", click.Context(sub, info_name=name, parent=ctx), lines, level + 1)
