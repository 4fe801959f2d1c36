"""Sphinx configuration of pynccl's API reference: ``sphinx-build -W -b html docs OUT``.

Built from the docstrings with autodoc and napoleon; importing pynccl for this loads no
library, so the reference builds on machines without NCCL or a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the pynccl of this checkout, installed or not
sys.path.insert(0, str(HERE / "_ext"))

import pynccl  # noqa: E402

project = "pynccl"
author = "pynccl contributors"
copyright = "pynccl contributors, Apache-2.0"
release = version = pynccl.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "pynccl_docs",  # the NCCL-release tables and the every-public-name check (docs/_ext)
]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
# Wide enough for the examples' 100-column lines.
html_theme_options = {"page_width": "1240px", "body_max_width": "none"}
html_title = f"pynccl {release}"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autoclass_content = "both"  # the class docstring, then __init__'s where it has one
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = True
