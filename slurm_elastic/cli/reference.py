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
    # Every command's -h/--help is left out: click keeps a command's help option from the first context
    # that built it, so its names would depend on what ran before (the page says it once instead).
    opts = [p for p in cmd.get_params(ctx) if isinstance(p, click.Option) and "--help" not in p.opts]
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


def render_settings() -> str:
    """slurm_elastic/settings.py's table as Markdown (docs/admin.md holds it; tests/test_docs.py compares)."""
    from slurm_elastic import settings

    lines = ["| setting | variable | option | default | heartbeat key | meaning |", "|---|---|---|---|---|---|"]
    section = None
    for s in settings.SETTINGS:
        if s.section != section:
            section = s.section
            lines.append(f"| **{section}** | | | | | |")
        option = f"`{s.option}`" + (f" ({', '.join(s.commands)})" if s.commands else "") if s.option else "-"
        meaning = s.help
        if s.choices:
            meaning += f" One of {', '.join(s.choices)}."
        elif s.minimum is not None or s.maximum is not None:
            meaning += f" Must be {s.bounds()}."
        if s.read_by != "slurm_elastic":
            meaning += " Read by the job templates."
        cells = [f"`{s.name}`", f"`{s.env}`" if s.env else "-", option,
                 "-" if s.default is None else f"`{s.default}`", f"`{s.heartbeat}`" if s.heartbeat else "-",
                 meaning.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
