"""Task prompts of the kinds users ask beyond chat: summarise a long document, answer from a
passage, extract fields, translate, and explain / document / fix / write code.

A draft chosen on MT-bench alone accepts 1.10 tokens on translation and 1.34 on summaries
(issue 44): its data held neither. The texts here ship with CPython itself under the PSF
licence (PSF-2.0): the language reference topics of `pydoc_data/topics.py` and the standard
library's module sources and docstrings, so the set is rebuilt offline from any CPython of the
same version. Every row names its source document; a document goes to the held-out split or
to training, never both, so stages chosen on the held-out split were not fit on its texts.
Deterministic in `seed` for one CPython version (recorded in each row's `package`).
"""

import ast
import json
import logging
import platform
import random
import re
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from megatron_specdec.checkpointing.checkpoint import write_bytes_atomic
from megatron_specdec.data.jsonl import DataError

log = logging.getLogger(__name__)

KINDS = ("summarize_long", "passage_qa", "extraction", "translation", "code")
LICENCE = "PSF-2.0"
TOPICS_PATH = "pydoc_data/topics.py"
# Plain-text documents shipped in the stdlib: IDLE's change logs (names, dates, issue numbers)
# and notes, and the licence history of Python itself.
TEXT_PATHS = ("idlelib/NEWS.txt", "idlelib/NEWS2x.txt", "idlelib/HISTORY.txt",
              "idlelib/README.txt", "idlelib/TODO.txt", "LICENSE.txt")
# Packages of the stdlib that are tests, GUI or vendored code rather than library modules.
SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
             "site-packages", "dist-packages", "config-3.11-x86_64-linux-gnu", "pydoc_data",
             "__pycache__", "venv", "distutils"}

SUMMARY_REQUESTS = (
    "Summarize the following document in a few paragraphs.\n\n{text}",
    "Here is a section of the Python language reference:\n\n{text}\n\nWrite a concise summary "
    "of it for a programmer who has not read it.",
    "{text}\n\nSummarize the text above in 5 bullet points.",
    "Read this document and give me a short summary of its main points:\n\n{text}",
    "{text}\n\nTL;DR: summarize this in one paragraph.",
)
MODULE_SUMMARY_REQUESTS = (
    "Summarize what this Python module provides and how it is organised.\n\n```python\n{text}\n```",
    "```python\n{text}\n```\n\nGive me an overview of the file above: its purpose, main "
    "classes and functions, in a short summary.",
)
QUESTIONS = (
    ("param", "What does the `{param}` argument of `{name}` do?"),
    ("param", "How is `{param}` used by `{name}`?"),
    ("return", "What does `{name}` return?"),
    ("raise", "When does `{name}` raise an exception, and which one?"),
    ("any", "What is `{name}` for, in one or two sentences?"),
    ("any", "Give an example of when I would call `{name}`."),
)
QA_FRAMES = (
    "Answer the question using only the documentation below.\n\nDocumentation of `{name}`:\n"
    "{text}\n\nQuestion: {question}",
    "{text}\n\nBased on the passage above, {question_lc}",
    "Here is the docstring of `{name}`:\n\n{text}\n\n{question}",
)
EXTRACTION_REQUESTS = (
    "Extract every number in the text below with what it refers to, as a JSON list of objects "
    "with keys \"value\" and \"refers_to\".\n\n{text}",
    "List every function, method, class and module name mentioned in this text as a JSON "
    "array of strings.\n\n{text}",
    "From the following text, extract the names of all keywords, operators and built-in types "
    "it mentions. Answer with a bulleted list.\n\n{text}",
    "{text}\n\nExtract the key terms defined in the passage above and give a one-line "
    "definition for each, as JSON: {{\"term\": \"definition\"}}.",
    "Read the text and fill in this JSON: {{\"topic\": ..., \"names_mentioned\": [...], "
    "\"numbers\": [...], \"exceptions\": [...]}}\n\n{text}",
    "List every person's name, date and version number in the text as JSON with keys "
    "\"people\", \"dates\" and \"versions\".\n\n{text}",
    "{text}\n\nExtract each change described above as a JSON list of objects with keys "
    "\"issue\" (the number, or null) and \"change\" (one line).",
    "Pull out every exception or error type named in this text and say when each occurs, as "
    "a table with columns Exception | When.\n\n{text}",
)
PARAM_EXTRACTION = (
    "Extract the parameters of `{name}` from its source code below as JSON: a list of objects "
    "with keys \"name\", \"default\" and \"purpose\".\n\n```python\n{code}\n```",
)
LANGUAGES = ("German", "French", "Spanish")
TRANSLATION_REQUESTS = (
    "Translate the following text into {lang}:\n\n{text}",
    "Translate to {lang}. Keep code names unchanged.\n\n{text}",
    "{text}\n\nTranslate the paragraph above into {lang}.",
    "Please translate this English text into {lang}:\n\"{text}\"",
)
CODE_REQUESTS = {
    "explain": ("Explain what this Python function does, step by step.\n\n```python\n{code}\n```",
                "```python\n{code}\n```\n\nWhat does this code do? Explain it briefly."),
    "document": ("Write a docstring for this Python function.\n\n```python\n{code}\n```",
                 "Add comments and a docstring to the following code.\n\n```python\n{code}\n```"),
    "fix": ("This function has a bug. Find it and give the corrected code.\n\n"
            "```python\n{code}\n```",
            "My function does not work as intended. What is wrong with it?\n\n"
            "```python\n{code}\n```"),
    "write": ("Write a Python function `{signature}` that does the following: {summary}",
              "Implement `{signature}` in Python. {summary}"),
}
# Small, plausible bugs for the "fix" requests: the first one that applies is made once.
BUGS = ((" <= ", " < "), (" >= ", " > "), (" == ", " != "), (" + 1", " - 1"), (" and ", " or "),
        ("[1:]", "[:1]"), (" is None", " is not None"))


@dataclass(frozen=True)
class TaskRow:
    """One prompt; `category` repeats `kind` because `validate` groups its report by it."""

    id: str
    kind: str
    category: str
    prompt: str
    document: str
    package: str
    path: str
    licence: str


@dataclass(frozen=True)
class _Item:
    kind: str
    document: str
    path: str
    prompt: str


def stdlib_dir(path: Optional[str] = None) -> Path:
    """CPython's stdlib directory (`path`, else this interpreter's); refused unless it holds
    pydoc_data/topics.py."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    for rel in (TOPICS_PATH,) + TEXT_PATHS:
        if not (root / rel).is_file():
            raise DataError(f"--stdlib {root}: missing source {rel} (expected CPython's "
                            f"standard library directory)")
    return root


def read_topics(root: Path) -> Dict[str, str]:
    """The language reference topics, read as data (ast.literal_eval, nothing executed)."""
    tree = ast.parse((root / TOPICS_PATH).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "topics":
            return ast.literal_eval(node.value)
    raise DataError(f"{root / TOPICS_PATH}: no 'topics' dict")


def module_files(root: Path) -> List[Path]:
    """Library module sources, sorted; tests, GUI and vendored packages left out."""
    files = [p for p in root.rglob("*.py")
             if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
             and not p.name.startswith("test")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def paragraphs(text: str) -> List[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def _prose(par: str) -> bool:
    """A paragraph of sentences: no grammar or code lines, no headings."""
    return (not par.startswith(" ") and not re.search(r"::=|>>>|\*\*\*|===|---", par)
            and par.rstrip().endswith((".", ":")) and par.count(" ") >= 8)


def long_chunks(text: str, count: Callable[[str], int], lo: int, hi: int) -> List[str]:
    """`text` cut at paragraph breaks into consecutive chunks of lo..hi tokens; a remainder
    shorter than lo is dropped."""
    chunks, cur, size = [], [], 0
    for par in paragraphs(text):
        n = count(par) + 1
        if cur and size + n > hi:
            chunks.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(par)
        size += n
    chunks.append("\n\n".join(cur))
    return [c for c in chunks if lo <= count(c) <= hi]


def passage_groups(text: str, min_words: int, max_words: int) -> Iterator[str]:
    """Runs of consecutive paragraphs of min..max words."""
    cur: List[str] = []
    for par in paragraphs(text) + [""]:
        words = sum(len(p.split()) for p in cur)
        if not par or words + len(par.split()) > max_words:
            if words >= min_words:
                yield "\n\n".join(cur)
            cur = []
        if par and len(par.split()) <= max_words:
            cur.append(par)


def _functions(root: Path, path: Path) -> Iterator[tuple]:
    """(qualified name, node, source) of the public functions and methods of one module."""
    source = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
    module = module.removesuffix(".__init__")
    for top in tree.body:
        nodes = [(top, "")]
        if isinstance(top, ast.ClassDef) and not top.name.startswith("_"):
            nodes = [(n, top.name + ".") for n in top.body]
        for node, prefix in nodes:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                code = ast.get_source_segment(source, node)
                if code:
                    yield f"{module}.{prefix}{node.name}", node, code


def _strip_docstring(node: ast.FunctionDef, code: str) -> Optional[str]:
    doc = ast.get_docstring(node, clean=False)
    if doc is None:
        return code
    body = node.body[1:]
    if not body:
        return None
    lines = code.splitlines()
    first = node.body[0].lineno - node.lineno
    last = node.body[0].end_lineno - node.lineno
    return "\n".join(lines[:first] + lines[last + 1:])


def _signature(node: ast.FunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def text_items(doc: str, path: str, text: str, count: Callable[[str], int], lo: int, hi: int,
               rng: random.Random) -> Iterator[_Item]:
    """Long-document summaries, extraction and translation prompts from one text document."""
    for chunk in long_chunks(text, count, lo, hi):
        yield _Item("summarize_long", doc, path,
                    rng.choice(SUMMARY_REQUESTS).replace("{text}", chunk))
    for group in passage_groups(text, 60, 350):
        if re.search(r"\d|\"[A-Za-z_]+\(\)\"|Error", group):
            yield _Item("extraction", doc, path,
                        rng.choice(EXTRACTION_REQUESTS).format(text=group))
    for par in paragraphs(text):
        if _prose(par) and 40 <= len(par.split()) <= 150:
            yield _Item("translation", doc, path, rng.choice(TRANSLATION_REQUESTS)
                        .format(lang=rng.choice(LANGUAGES), text=" ".join(par.split())))


def _question(name: str, node: ast.FunctionDef, doc: str, rng: random.Random) -> str:
    params = [a.arg for a in node.args.args + node.args.kwonlyargs
              if a.arg not in ("self", "cls") and re.search(rf"\b{re.escape(a.arg)}\b", doc)]
    fits = {"param": bool(params), "return": "return" in doc.lower(),
            "raise": bool(re.search(r"rais|Error", doc)), "any": True}
    _, template = rng.choice([q for q in QUESTIONS if fits[q[0]]])
    return template.format(name=name, param=rng.choice(params) if params else "")


def module_items(root: Path, path: Path, count: Callable[[str], int], lo: int, hi: int,
                 rng: random.Random) -> Iterator[_Item]:
    """A whole-module summary when the module is lo..hi tokens long; passage questions,
    parameter extraction and code requests from its functions."""
    rel = path.relative_to(root).as_posix()
    doc_id = f"stdlib:{rel}"
    source = path.read_text(encoding="utf-8", errors="replace").strip()
    if lo <= count(source) <= hi:
        yield _Item("summarize_long", doc_id, rel,
                    rng.choice(MODULE_SUMMARY_REQUESTS).replace("{text}", source))
    for name, node, code in _functions(root, path):
        doc = ast.get_docstring(node) or ""
        n_lines = code.count("\n") + 1
        if len(doc) >= 300:
            question = _question(name, node, doc, rng)
            yield _Item("passage_qa", doc_id, rel, rng.choice(QA_FRAMES).format(
                name=name, text=doc, question=question,
                question_lc=question[0].lower() + question[1:]))
        if not 8 <= n_lines <= 60:
            continue
        if len(node.args.args) + len(node.args.kwonlyargs) >= 3 and rng.random() < 0.3:
            yield _Item("extraction", doc_id, rel,
                        rng.choice(PARAM_EXTRACTION).format(name=name, code=code))
        action = rng.choice(sorted(CODE_REQUESTS))
        if action == "document":
            code = _strip_docstring(node, code)
        elif action == "fix":
            bug = next((b for b in BUGS if b[0] in code), None)
            code = code.replace(*bug, 1) if bug else None
        elif action == "write":
            summary = doc.split("\n\n")[0].replace("\n", " ").strip()
            if len(summary) < 40:
                continue
            yield _Item("code", doc_id, rel, rng.choice(CODE_REQUESTS[action]).format(
                signature=_signature(node), summary=summary))
            continue
        if code:
            yield _Item("code", doc_id, rel, rng.choice(CODE_REQUESTS[action]).format(code=code))


def check_kinds(kinds: Sequence[str]) -> tuple:
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise DataError(f"--kinds: unknown kind {unknown[0] if unknown else ''!r}; "
                        f"kinds: {', '.join(KINDS)}")
    return tuple(dict.fromkeys(kinds))


def build_tasks(root: Path, count: Callable[[str], int], kinds: Sequence[str] = KINDS,
                train_per_kind: int = 100, heldout_per_kind: int = 16, seed: int = 0,
                long_tokens: tuple = (1000, 2000)) -> tuple:
    """(train rows, held-out rows): per kind, `heldout_per_kind` held-out prompts and up to
    `train_per_kind` training prompts, whose source documents are disjoint across the two
    splits. `count` gives a text's token count (long documents are `long_tokens` long)."""
    kinds = check_kinds(kinds)
    rng = random.Random(seed)
    topics = read_topics(root)
    items: List[_Item] = []
    for key in sorted(topics):
        items.extend(text_items(f"topics:{key}", TOPICS_PATH, topics[key], count, *long_tokens,
                                rng))
    for rel in TEXT_PATHS:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        items.extend(text_items(f"stdlib:{rel}", rel, text, count, *long_tokens, rng))
    for path in module_files(root):
        items.extend(module_items(root, path, count, *long_tokens, rng))
    by_kind = {k: [it for it in items if it.kind == k] for k in kinds}
    documents = sorted({it.document for it in items})
    rng.shuffle(documents)
    heldout_docs: set = set()
    heldout: Dict[str, List[_Item]] = {}
    for kind in kinds:
        pool = by_kind[kind]
        if len(pool) < 2 * heldout_per_kind:
            raise DataError(f"kind {kind!r}: only {len(pool)} prompts in {root}")
        docs_of_kind = [d for d in documents if any(it.document == d for it in pool)]
        chosen: List[_Item] = [it for it in pool if it.document in heldout_docs]
        for doc in docs_of_kind:
            if len(chosen) >= heldout_per_kind:
                break
            if doc not in heldout_docs:
                heldout_docs.add(doc)
                chosen.extend(it for it in pool if it.document == doc)
        heldout[kind] = chosen
    version = f"cpython-{platform.python_version()}"
    held_per_kind, per_kind = [], []
    for kind in kinds:
        pick = random.Random(f"{seed}:{kind}")
        h = heldout[kind]
        held_per_kind.append(pick.sample(h, min(heldout_per_kind, len(h))))
        pool = [it for it in by_kind[kind] if it.document not in heldout_docs]
        per_kind.append(pick.sample(pool, min(train_per_kind, len(pool))))
    # Held-out kinds in turn, so `validate --num-prompts 5n` reads n of each.
    held = [it for i in range(heldout_per_kind) for rows in held_per_kind for it in rows[i:i + 1]]
    train = [it for rows in per_kind for it in rows]

    def rows(items, split):
        return [TaskRow(f"tasks-{split}-{seed}-{i:05d}", it.kind, it.kind, it.prompt,
                        it.document, version, it.path, LICENCE) for i, it in enumerate(items)]
    return rows(train, "train"), rows(held, "heldout")


def write_rows(rows: Sequence[TaskRow], out) -> None:
    """jsonl at `out` (.gz compressed), written to a temporary file and renamed into place."""
    import gzip

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    write_bytes_atomic(out, gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)
    log.info("%d task prompts -> %s", len(rows), out)
