"""mkdocs hook: fill docs/cli.md from the click commands, so the reference cannot go stale."""

from __future__ import annotations

MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs hook signature)
    if MARKER not in markdown:
        return markdown
    from slurm_elastic.cli import main
    from slurm_elastic.cli.reference import render_reference

    return markdown.replace(MARKER, render_reference(main))
