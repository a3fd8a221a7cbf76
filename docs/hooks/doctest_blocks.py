"""MkDocs hook: doctest examples in docstrings render as ``pycon`` code blocks.

keras_dist's docstrings show their examples as bare doctest blocks (``>>>`` lines, then the
output), which ``tests/docs/test_docs.py`` runs. Markdown would read the ``>`` as block quotes and
``[2.0, 3.0]`` in an output as a link, so this fences every such block before the other
preprocessors (superfences included) see it. Lines already inside a fence are left alone.
"""

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_FENCE = re.compile(r"^\s*(```|~~~)")
_PROMPT = re.compile(r"^(\s*)>>>( |$)")


class _DoctestBlocks(Preprocessor):
    def run(self, lines):
        out, fenced, index = [], False, 0
        while index < len(lines):
            line = lines[index]
            if _FENCE.match(line):
                fenced = not fenced
            match = None if fenced else _PROMPT.match(line)
            if not match:
                out.append(line)
                index += 1
                continue
            indent = match.group(1)
            out += ["", f"{indent}```pycon"]
            while index < len(lines) and lines[index].strip():
                out.append(lines[index])
                index += 1
            out += [f"{indent}```", ""]
        return out


class DoctestBlocksExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Markdown's API)
        # Superfences reads fences at priority 25; whitespace is normalized at 30.
        md.preprocessors.register(_DoctestBlocks(md), "doctest_blocks", 28)


@event_priority(100)  # before mkdocstrings builds its Markdown from this list
def on_config(config):
    config.markdown_extensions.append(DoctestBlocksExtension())
    return config
