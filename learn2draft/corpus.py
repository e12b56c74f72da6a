"""The real-work corpus: a deterministic, offline builder of ``learn2draft/data/corpus.json``.

The corpus is built from public sources whose licences allow shipping them; the extracts it reads live in
:data:`SOURCES_DIR` (one folder per source, each with its licence, named in its ``SOURCES.md``):

- ``gsm8k-train``: GSM8K *train* word problems (MIT);
- ``humaneval``: HumanEval's function prompts and canonical solutions (MIT);
- ``pydoc-topics``: the Python language reference as shipped in ``pydoc_data.topics`` (PSF);
- ``cpython-stdlib``: functions, methods and classes of CPython's standard library (PSF);
- ``django-locale``: Django's interface messages with their Spanish, Italian and Chinese translations (BSD-3);
- ``faker``: people, addresses and companies generated with Faker's en_US, es_ES, it_IT and zh_CN providers (MIT).

Each prompt is an MT-bench style record (``question_id``, ``category``, ``language``, ``turns``) that also names
its ``source`` and the ``document`` it came from. Documents are assigned to ``corpus_train`` /
``corpus_validation`` / ``corpus_test`` by a hash of their id (about 60/15/25), so a document is never in two
splits; one whole source, :data:`LOSO_SOURCE`, is held out of all three and forms ``corpus_loso``.

Kept apart (never read): Spec-Bench's questions and its sources (GSM8K test, MT-bench, WMT14, CNN/DailyMail,
Natural Questions, DPR), the confirmation set.

Run ``python -m learn2draft.corpus`` to rebuild, ``--check`` to verify the shipped file equals a fresh build.
Only the standard library is used.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
from pathlib import Path

SOURCES_DIR = Path(__file__).resolve().parent / "data" / "corpus_sources"
CORPUS_FILE = Path(__file__).resolve().parent / "data" / "corpus.json"

#: Source name → (licence, data file, licence file), paths relative to the sources folder.
SOURCES = {
    "gsm8k-train": ("MIT", "gsm8k-train/train.jsonl", "gsm8k-train/LICENSE"),
    "humaneval": ("MIT", "humaneval/HumanEval.jsonl", "humaneval/LICENSE"),
    "pydoc-topics": ("PSF-2.0", "pydoc-topics/topics.json", "pydoc-topics/LICENSE"),
    "cpython-stdlib": ("PSF-2.0", "cpython-stdlib/functions.jsonl", "cpython-stdlib/LICENSE"),
    "django-locale": ("BSD-3-Clause", "django-locale/messages.jsonl", "django-locale/LICENSE"),
    "faker": ("MIT", "faker/records.jsonl", "faker/LICENSE"),
}
#: The source held out of train / validation / test: its prompts form ``corpus_loso``. Faker's records feed
#: writing (chat), extraction and record edits in all four languages, kinds of work that other sources also
#: cover, so the held-out set asks for known kinds of work on text from a source never trained on.
LOSO_SOURCE = "faker"
#: Spec-Bench's questions and sources: the confirmation set, never part of this corpus.
FORBIDDEN_SOURCES = ("gsm8k-test", "mt-bench", "wmt14", "cnn-dailymail", "natural-questions", "dpr", "spec-bench")
LANGUAGES = ("en", "es", "it", "zh")
CATEGORIES = ("chat", "code", "code_edit", "math", "translation", "summarization", "rag", "context_qa",
              "extraction", "qa", "copy_edit")
#: Categories over a long document (each prompt at least :data:`LONG_MIN` characters).
LONG_CATEGORIES = ("summarization", "rag", "context_qa")
LONG_MIN, PROMPT_MAX = 2000, 6000
#: Prompts per category and language (en, es, it, zh).
COUNTS = {
    "chat": (40, 15, 15, 15), "code": (40, 12, 12, 12), "code_edit": (40, 12, 12, 12), "math": (40, 12, 12, 12),
    "translation": (40, 15, 15, 15), "summarization": (33, 13, 13, 13), "rag": (33, 13, 13, 13),
    "context_qa": (33, 13, 13, 13), "extraction": (30, 12, 12, 12), "qa": (30, 12, 12, 12),
    "copy_edit": (30, 12, 12, 12),
}
SPLIT_NAMES = ("corpus_train", "corpus_validation", "corpus_test", "corpus_loso")
SEED = 38


class CorpusSourceError(ValueError):
    """A source file of the corpus is missing or malformed; the message names the file (and line)."""


# --------------------------------------------------------------------------------------------- reading sources
def _read_text(path: Path) -> str:
    if not path.is_file():
        raise CorpusSourceError(f"{path}: missing corpus source file (expected in the sources folder; see its "
                                "SOURCES.md).")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise CorpusSourceError(f"{path}:{line}: not UTF-8 text (byte {e.start}).") from None


def _check_fields(row, fields: dict, where: str) -> dict:
    if not isinstance(row, dict):
        raise CorpusSourceError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    for name, kind in fields.items():
        if name not in row:
            raise CorpusSourceError(f"{where}: missing field {name!r}.")
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise CorpusSourceError(f"{where}: field {name!r} must be {kind.__name__}, got {row[name]!r:.60}.")
        if kind is str and not row[name].strip() and name != "docstring":
            raise CorpusSourceError(f"{where}: field {name!r} is empty.")
    return row


def _read_jsonl(path: Path, fields: dict) -> list[dict]:
    rows = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusSourceError(f"{path}:{n}: not valid JSON ({e.msg}).") from None
        rows.append(_check_fields(row, fields, f"{path}:{n}"))
    if not rows:
        raise CorpusSourceError(f"{path}: holds no record.")
    return rows


def _read_topics(path: Path) -> dict[str, str]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise CorpusSourceError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None
    if not isinstance(data, dict) or not data:
        raise CorpusSourceError(f"{path}: expected a JSON object of topic name → text.")
    for k, v in data.items():
        if not isinstance(v, str) or not v.strip():
            raise CorpusSourceError(f"{path}: topic {k!r} must be a non-empty string.")
    return data


_FIELDS = {
    "gsm8k-train": {"index": int, "question": str, "answer": str},
    "humaneval": {"task_id": str, "prompt": str, "canonical_solution": str, "entry_point": str},
    "cpython-stdlib": {"module": str, "qualname": str, "kind": str, "source": str, "docstring": str},
    "django-locale": {"domain": str, "en": str, "es": str, "it": str, "zh": str},
    "faker": {"id": str, "language": str, "name": str, "address": str, "city": str, "company": str,
              "phone": str, "email": str, "date": str, "text": str},
}


def read_sources(sources_dir: str | Path = SOURCES_DIR) -> dict:
    """Read and check every source extract of :data:`SOURCES` from ``sources_dir``.

    Returns ``{source name: rows}`` (``pydoc-topics``: a dict of topic name → text; the others: lists of dicts).

    Raises:
        CorpusSourceError: a missing data or licence file, a file that is not UTF-8, a line that is not JSON, a
            record with a missing or mistyped field, or a record of an unknown language (the message names the
            file and, where there is one, the line).
    """
    root = Path(sources_dir)
    out = {}
    for name, (_licence, data_file, licence_file) in sorted(SOURCES.items()):
        _read_text(root / licence_file)
        path = root / data_file
        out[name] = _read_topics(path) if name == "pydoc-topics" else _read_jsonl(path, _FIELDS[name])
    for n, row in enumerate(out["faker"], 1):
        if row["language"] not in LANGUAGES:
            raise CorpusSourceError(f"{root / SOURCES['faker'][1]}: record {n}: unknown language "
                                    f"{row['language']!r}.")
    return out


# --------------------------------------------------------------------------------------------- splits
def split_of(source: str, document: str) -> str:
    """The split of a document: ``corpus_loso`` for :data:`LOSO_SOURCE`, else by the SHA-256 of its id
    (0-59 of 100: ``corpus_train``, 60-74: ``corpus_validation``, 75-99: ``corpus_test``)."""
    if source == LOSO_SOURCE:
        return "corpus_loso"
    bucket = int(hashlib.sha256(document.encode("utf-8")).hexdigest(), 16) % 100
    return "corpus_train" if bucket < 60 else "corpus_validation" if bucket < 75 else "corpus_test"


# --------------------------------------------------------------------------------------------- the documents
def _chunks(text: str, lo: int = 2200, target: int = 3400, hi: int = 5000) -> list[str]:
    """Cut a long text at paragraph boundaries into pieces of ``lo``..``hi`` characters (about ``target``)."""
    paras: list[str] = []
    for p in text.strip().split("\n\n"):
        while len(p) > hi:  # a very long paragraph: cut at a line break
            cut = p.rfind("\n", 0, hi)
            cut = cut if cut > 0 else hi
            paras.append(p[:cut])
            p = p[cut:].lstrip("\n")
        paras.append(p)
    out, cur = [], ""
    for p in paras:
        if cur and len(cur) + 2 + len(p) > hi:
            out.append(cur)
            cur = p
        else:
            cur = f"{cur}\n\n{p}" if cur else p
        if len(cur) >= target:
            out.append(cur)
            cur = ""
    if cur:
        if out and len(out[-1]) + 2 + len(cur) <= hi:
            out[-1] = f"{out[-1]}\n\n{cur}"
        else:
            out.append(cur)
    out = [c.strip("\n") for c in out]
    return [c for c in out if lo <= len(c) <= hi]


class _Pool:
    """Items shuffled once by a fixed seed, handed out in turn (starting over when used up)."""

    def __init__(self, items: list, seed: str):
        self.items = list(items)
        random.Random(seed).shuffle(self.items)
        self.i = 0

    def next(self, accept=lambda item: True):
        for _ in range(len(self.items)):
            item = self.items[self.i % len(self.items)]
            self.i += 1
            if accept(item):
                return item
        raise CorpusSourceError("no source item fits the request (the sources folder holds too few records).")


_TERM = re.compile(r'"([A-Za-z_][A-Za-z0-9_.]{2,30}(?:\(\))?)"')


def _terms(text: str) -> list[str]:
    seen: dict[str, None] = {}
    for t in _TERM.findall(text):
        seen.setdefault(t, None)
    return list(seen)


def _clean_gsm8k(answer: str) -> tuple[str, str]:
    body, _, final = answer.partition("####")
    return re.sub(r"<<[^>]*>>", "", body).strip(), final.strip()


# --------------------------------------------------------------------------------------------- templates
NAMES = {"en": {"en": "English", "es": "Spanish", "it": "Italian", "zh": "Chinese"},
         "es": {"en": "inglés", "es": "español", "it": "italiano", "zh": "chino"},
         "it": {"en": "inglese", "es": "spagnolo", "it": "italiano", "zh": "cinese"},
         "zh": {"en": "英文", "es": "西班牙文", "it": "意大利文", "zh": "中文"}}

T = {
    "math": {
        "en": "Solve the following word problem step by step, then give the final answer on its own line.\n\n{q}",
        "es": "Resuelve el siguiente problema paso a paso y responde en español; da la respuesta final en una línea "
              "aparte.\n\n{q}",
        "it": "Risolvi il seguente problema passo per passo e rispondi in italiano; scrivi la risposta finale su una "
              "riga a parte.\n\n{q}",
        "zh": "请用中文逐步解答下面的应用题，并在最后单独一行写出最终答案。\n\n{q}"},
    "code": {
        "en": "Complete the following Python function. Return the whole function in a code block.\n\n"
              "```python\n{p}```",
        "es": "Completa la siguiente función de Python. Devuelve la función completa en un bloque de código.\n\n"
              "```python\n{p}```",
        "it": "Completa la seguente funzione Python. Restituisci l'intera funzione in un blocco di codice.\n\n"
              "```python\n{p}```",
        "zh": "请补全下面的 Python 函数，并在代码块中返回完整的函数。\n\n```python\n{p}```"},
    "code2": {
        "en": "Implement `{e}` as its docstring describes, then explain your approach in two sentences.\n\n"
              "```python\n{p}```",
        "es": "Implementa `{e}` tal como lo describe su docstring y después explica tu enfoque en dos frases.\n\n"
              "```python\n{p}```",
        "it": "Implementa `{e}` come descritto dalla sua docstring, poi spiega il tuo approccio in due frasi.\n\n"
              "```python\n{p}```",
        "zh": "按照文档字符串的描述实现 `{e}`，然后用两句话说明你的思路。\n\n```python\n{p}```"},
    "chat_head": {"en": "Here is our conversation so far:", "es": "Esta es nuestra conversación hasta ahora:",
                  "it": "Ecco la nostra conversazione finora:", "zh": "以下是我们到目前为止的对话："},
    "chat_foot": {"en": "Reply to my last message.", "es": "Responde a mi último mensaje.",
                  "it": "Rispondi al mio ultimo messaggio.", "zh": "请回复我的最后一条消息。"},
    "chat_user": {"en": "User", "es": "Usuario", "it": "Utente", "zh": "用户"},
    "chat_bot": {"en": "Assistant", "es": "Asistente", "it": "Assistente", "zh": "助手"},
    "chat_answer": {"en": "Answer: {a}", "es": "Respuesta: {a}", "it": "Risposta: {a}", "zh": "答案：{a}"},
    "chat_math_ask": {"en": "Can you help me solve this?\n\n{q}", "es": "¿Me ayudas a resolver esto?\n\n{q}",
                      "it": "Mi aiuti a risolvere questo?\n\n{q}", "zh": "你能帮我解这道题吗？\n\n{q}"},
    "chat_math_follow": {
        "en": ("Thanks. Now write a similar problem with different numbers and solve it the same way.",
               "I don't follow the second step. Can you explain it again more simply?"),
        "es": ("Gracias. Ahora escribe un problema parecido con otros números y resuélvelo de la misma manera.",
               "No entiendo el segundo paso. ¿Puedes explicarlo otra vez de forma más sencilla?"),
        "it": ("Grazie. Ora scrivi un problema simile con numeri diversi e risolvilo allo stesso modo.",
               "Non capisco il secondo passaggio. Puoi spiegarlo di nuovo in modo più semplice?"),
        "zh": ("谢谢。现在请换一组数字，写一道类似的题目，并用同样的方法解答。", "我没看懂第二步。你能用更简单的方式再解释一遍吗？")},
    "chat_code_ask": {"en": "Write this Python function for me:\n\n```python\n{p}```",
                      "es": "Escríbeme esta función de Python:\n\n```python\n{p}```",
                      "it": "Scrivimi questa funzione Python:\n\n```python\n{p}```",
                      "zh": "请帮我写这个 Python 函数：\n\n```python\n{p}```"},
    "chat_code_follow": {
        "en": ("Now add three assert-based tests for it and say what each one checks.",
               "Can you rewrite it to be more readable and explain what you changed?"),
        "es": ("Ahora añade tres pruebas con assert y di qué comprueba cada una.",
               "¿Puedes reescribirla para que sea más legible y explicar qué cambiaste?"),
        "it": ("Ora aggiungi tre test basati su assert e di' che cosa controlla ciascuno.",
               "Puoi riscriverla in modo più leggibile e spiegare che cosa hai cambiato?"),
        "zh": ("现在为它添加三个基于 assert 的测试，并说明每个测试检查什么。", "你能把它改写得更易读，并说明你改了哪些地方吗？")},
    "chat_write": {
        "en": "Write a short, friendly e-mail from {name} of {company} to a client, proposing a meeting in {city} "
              "on {date} and giving the phone number {phone} for questions. Use this note for the details:\n\n{text}",
        "es": "Escribe un correo breve y cordial de {name}, de {company}, a un cliente, proponiendo una reunión en "
              "{city} el {date} e indicando el teléfono {phone} para dudas. Usa esta nota para los detalles:\n\n{text}",
        "it": "Scrivi una breve e cordiale e-mail di {name}, di {company}, a un cliente, proponendo un incontro a "
              "{city} il {date} e indicando il telefono {phone} per domande. Usa questa nota per i dettagli:\n\n{text}",
        "zh": "请以{company}的{name}的名义给一位客户写一封简短友好的电子邮件，提议于{date}在{city}见面，并留下电话{phone}"
              "以便对方咨询。细节请参考这段备注：\n\n{text}"},
    "rename": {
        "en": "Rename the variable `{old}` to `{new}` in this code from Python's `{m}` module. Return the whole code "
              "with no other changes.",
        "es": "Cambia el nombre de la variable `{old}` a `{new}` en este código del módulo `{m}` de Python. Devuelve "
              "el código completo sin otros cambios.",
        "it": "Rinomina la variabile `{old}` in `{new}` in questo codice del modulo `{m}` di Python. Restituisci "
              "l'intero codice senza altre modifiche.",
        "zh": "把这段来自 Python `{m}` 模块的代码中的变量 `{old}` 重命名为 `{new}`，不做其他修改，返回完整的代码。"},
    "hints": {
        "en": "Add type hints to every parameter and return value in this code from Python's `{m}` module. Return "
              "the full code.",
        "es": "Añade anotaciones de tipo a todos los parámetros y valores de retorno de este código del módulo `{m}` "
              "de Python. Devuelve el código completo.",
        "it": "Aggiungi le annotazioni di tipo a tutti i parametri e ai valori di ritorno di questo codice del modulo "
              "`{m}` di Python. Restituisci il codice completo.",
        "zh": "为这段来自 Python `{m}` 模块的代码的所有参数和返回值添加类型注解，并返回完整代码。"},
    "docstring": {
        "en": "Write a Google-style docstring for this code from Python's `{m}` module (its arguments, return value "
              "and the exceptions it raises) and return the full code with the new docstring in place.",
        "es": "Escribe un docstring al estilo de Google para este código del módulo `{m}` de Python (argumentos, "
              "valor devuelto y excepciones) y devuelve el código completo con el nuevo docstring.",
        "it": "Scrivi una docstring in stile Google per questo codice del modulo `{m}` di Python (argomenti, valore "
              "restituito ed eccezioni) e restituisci il codice completo con la nuova docstring.",
        "zh": "为这段来自 Python `{m}` 模块的代码编写 Google 风格的文档字符串（参数、返回值和可能抛出的异常），并返回放入新"
              "文档字符串后的完整代码。"},
    "strip": {
        "en": "Remove every comment and docstring from this code from Python's `{m}` module, keep the code itself "
              "exactly as it is, and return it.",
        "es": "Elimina todos los comentarios y docstrings de este código del módulo `{m}` de Python, deja el código "
              "exactamente igual y devuélvelo.",
        "it": "Rimuovi tutti i commenti e le docstring da questo codice del modulo `{m}` di Python, lascia il codice "
              "esattamente com'è e restituiscilo.",
        "zh": "删除这段来自 Python `{m}` 模块的代码中的所有注释和文档字符串，代码本身保持原样，然后返回。"},
    "dataclass": {
        "en": "Convert this class from Python's `{m}` module into a dataclass, keeping its methods unchanged. Return "
              "the full class.",
        "es": "Convierte esta clase del módulo `{m}` de Python en una dataclass, sin cambiar sus métodos. Devuelve "
              "la clase completa.",
        "it": "Converti questa classe del modulo `{m}` di Python in una dataclass, senza cambiare i suoi metodi. "
              "Restituisci la classe completa.",
        "zh": "把这个来自 Python `{m}` 模块的类改写为 dataclass，方法保持不变，并返回完整的类。"},
    "standalone": {
        "en": "Rewrite this method from Python's `{m}` module as a standalone function that takes the object as its "
              "first argument `obj` instead of `self`. Return the full function.",
        "es": "Reescribe este método del módulo `{m}` de Python como una función independiente que reciba el objeto "
              "como primer argumento `obj` en lugar de `self`. Devuelve la función completa.",
        "it": "Riscrivi questo metodo del modulo `{m}` di Python come una funzione indipendente che riceve l'oggetto "
              "come primo argomento `obj` invece di `self`. Restituisci la funzione completa.",
        "zh": "把这个来自 Python `{m}` 模块的方法改写为独立函数：用第一个参数 `obj` 代替 `self` 接收对象，并返回完整的函数。"},
    "translation": {
        "en": "Translate these user-interface messages of a web framework from English into {tgt}. Keep "
              "placeholders such as %(name)s unchanged and keep the numbering.\n\n{items}",
        "es": "Traduce del español al {tgt} estos mensajes de la interfaz de un framework web. Mantén sin cambios "
              "los marcadores como %(name)s y conserva la numeración.\n\n{items}",
        "it": "Traduci dall'italiano in {tgt} questi messaggi dell'interfaccia di un framework web. Lascia invariati "
              "i segnaposto come %(name)s e mantieni la numerazione.\n\n{items}",
        "zh": "请把下面这些 Web 框架界面消息从中文翻译成{tgt}。保留 %(name)s 之类的占位符不变，并保持编号。\n\n{items}"},
    "summarization": {
        "en": "Summarize the following section of the Python language documentation in five to seven sentences. "
              "Mention the main rules it states.\n\n{doc}",
        "es": "Resume en español, en cinco a siete frases, la siguiente sección de la documentación del lenguaje "
              "Python. Menciona las reglas principales que establece.\n\n{doc}",
        "it": "Riassumi in italiano, in cinque-sette frasi, la seguente sezione della documentazione del linguaggio "
              "Python. Cita le regole principali che stabilisce.\n\n{doc}",
        "zh": "请用中文分五到七句话总结下面这段 Python 语言文档，并提到其中给出的主要规则。\n\n{doc}"},
    "rag": {
        "en": "Answer the question using only the retrieved passages below, and cite the numbers of the passages "
              "you used. If they do not contain the answer, say so.\n\n{passages}\n\nQuestion: What do the passages "
              "say about \"{term}\"?",
        "es": "Responde en español a la pregunta usando solo los pasajes recuperados de abajo, y cita los números de "
              "los pasajes que uses. Si no contienen la respuesta, dilo.\n\n{passages}\n\nPregunta: ¿Qué dicen los "
              "pasajes sobre \"{term}\"?",
        "it": "Rispondi in italiano alla domanda usando solo i passaggi recuperati qui sotto, e cita i numeri dei "
              "passaggi che usi. Se non contengono la risposta, dillo.\n\n{passages}\n\nDomanda: Che cosa dicono i "
              "passaggi su \"{term}\"?",
        "zh": "请只根据下面检索到的段落用中文回答问题，并注明所用段落的编号。如果段落中没有答案，请直接说明。\n\n{passages}\n\n"
              "问题：这些段落关于“{term}”说了什么？"},
    "context_qa": {
        "en": "Read the document below and answer the question after it. Quote exactly the sentences you rely on."
              "\n\n{doc}\n\nQuestion: {question}",
        "es": "Lee el documento de abajo y responde en español a la pregunta que le sigue. Cita literalmente las "
              "frases en las que te basas.\n\n{doc}\n\nPregunta: {question}",
        "it": "Leggi il documento qui sotto e rispondi in italiano alla domanda che segue. Cita testualmente le frasi "
              "su cui ti basi.\n\n{doc}\n\nDomanda: {question}",
        "zh": "请阅读下面的文档，并用中文回答文档后面的问题。请逐字引用你所依据的句子。\n\n{doc}\n\n问题：{question}"},
    "cqa_term": {"en": "How does this document describe \"{term}\"?",
                 "es": "¿Cómo describe este documento \"{term}\"?",
                 "it": "Come descrive questo documento \"{term}\"?", "zh": "这份文档是如何描述“{term}”的？"},
    "cqa_grammar": {
        "en": "Which grammar rules (the lines containing \"::=\") does the document give? Copy each one exactly and "
              "explain it in one sentence.",
        "es": "¿Qué reglas gramaticales (las líneas que contienen \"::=\") da el documento? Copia cada una "
              "exactamente y explícala en una frase.",
        "it": "Quali regole grammaticali (le righe che contengono \"::=\") fornisce il documento? Copia ciascuna "
              "esattamente e spiegala in una frase.",
        "zh": "文档给出了哪些语法规则（包含“::=”的行）？请逐字抄录每一条，并用一句话解释。"},
    "ext_note": {
        "en": "Extract the person's name, company, phone number, e-mail address and postal address from the note "
              "below. Answer with a JSON object with the keys name, company, phone, email and address, copying the "
              "values exactly.\n\n{note}",
        "es": "Extrae de la nota de abajo el nombre de la persona, la empresa, el teléfono, el correo electrónico y "
              "la dirección postal. Responde con un objeto JSON con las claves name, company, phone, email y "
              "address, copiando los valores exactamente.\n\n{note}",
        "it": "Estrai dalla nota qui sotto il nome della persona, l'azienda, il telefono, l'indirizzo e-mail e "
              "l'indirizzo postale. Rispondi con un oggetto JSON con le chiavi name, company, phone, email e "
              "address, copiando i valori esattamente.\n\n{note}",
        "zh": "从下面的备注中提取此人的姓名、公司、电话号码、电子邮箱和通信地址。请用一个 JSON 对象回答，键为 name、company、"
              "phone、email 和 address，值须逐字照抄。\n\n{note}"},
    "note": {"en": "Meeting notes, {date}. {name} from {company} called about the contract. Reach them at {phone} "
                   "or {email}; postal address: {address}. {text}",
             "es": "Notas de la reunión, {date}. {name}, de {company}, llamó por el contrato. Contacto: {phone} o "
                   "{email}; dirección postal: {address}. {text}",
             "it": "Appunti della riunione, {date}. {name} di {company} ha chiamato per il contratto. Contatti: "
                   "{phone} o {email}; indirizzo postale: {address}. {text}",
             "zh": "会议记录，{date}。{company}的{name}来电询问合同事宜。联系方式：{phone} 或 {email}；通信地址：{address}。{text}"},
    "ext_terms": {
        "en": "List every term that appears in double quotes in the following text, in order of first appearance, "
              "one per line, without repeats.\n\n{doc}",
        "es": "Enumera todos los términos que aparecen entre comillas dobles en el siguiente texto, en orden de "
              "primera aparición, uno por línea y sin repetir.\n\n{doc}",
        "it": "Elenca tutti i termini che compaiono tra virgolette doppie nel testo seguente, in ordine di prima "
              "apparizione, uno per riga e senza ripetizioni.\n\n{doc}",
        "zh": "请按首次出现的顺序列出下文中所有用双引号括起来的术语，每行一个，不要重复。\n\n{doc}"},
    "ext_numbers": {
        "en": "Extract every quantity mentioned in this word problem. Answer with a JSON list of objects with the "
              "keys value, unit and meaning; do not solve the problem.\n\n{q}",
        "es": "Extrae todas las cantidades que se mencionan en este problema. Responde con una lista JSON de objetos "
              "con las claves value, unit y meaning (meaning en español); no resuelvas el problema.\n\n{q}",
        "it": "Estrai tutte le quantità menzionate in questo problema. Rispondi con una lista JSON di oggetti con le "
              "chiavi value, unit e meaning (meaning in italiano); non risolvere il problema.\n\n{q}",
        "zh": "提取这道应用题中提到的所有数量。请用 JSON 列表回答，每个对象包含 value、unit 和 meaning 三个键（meaning 用"
              "中文）；不要解题。\n\n{q}"},
    "qa_func": {"en": "In Python's standard library, what does `{m}.{q}` do? Answer in one or two sentences.",
                "es": "En la biblioteca estándar de Python, ¿qué hace `{m}.{q}`? Responde en una o dos frases.",
                "it": "Nella libreria standard di Python, che cosa fa `{m}.{q}`? Rispondi in una o due frasi.",
                "zh": "在 Python 标准库中，`{m}.{q}` 是做什么的？请用一两句话回答。"},
    "qa_topic": {"en": "Python question: {h}. Explain briefly what it is and give a one-line example.",
                 "es": "Pregunta sobre Python: {h}. Explica brevemente qué es y da un ejemplo de una línea.",
                 "it": "Domanda su Python: {h}. Spiega brevemente che cos'è e fai un esempio di una riga.",
                 "zh": "Python 问题：{h}。请简要说明它是什么，并给出一行示例。"},
    "edit_record": {
        "en": "Change the city of this customer record to \"{city}\" and its phone to \"{phone}\", leaving every "
              "other field exactly as it is. Return the whole JSON.\n\n```json\n{json}\n```",
        "es": "Cambia la ciudad de este registro de cliente a \"{city}\" y su teléfono a \"{phone}\", dejando todos "
              "los demás campos exactamente igual. Devuelve el JSON completo.\n\n```json\n{json}\n```",
        "it": "Cambia la città di questo record cliente in \"{city}\" e il telefono in \"{phone}\", lasciando tutti "
              "gli altri campi esattamente come sono. Restituisci l'intero JSON.\n\n```json\n{json}\n```",
        "zh": "把这条客户记录的城市改为“{city}”，电话改为“{phone}”，其他字段保持完全不变。返回完整的 JSON。\n\n"
              "```json\n{json}\n```"},
    "csv_table": {
        "en": "Reformat this CSV as a Markdown table with the same columns and rows, copying every value "
              "exactly.\n\n{csv}",
        "es": "Convierte este CSV en una tabla Markdown con las mismas columnas y filas, copiando cada valor "
              "exactamente.\n\n{csv}",
        "it": "Trasforma questo CSV in una tabella Markdown con le stesse colonne e righe, copiando ogni valore "
              "esattamente.\n\n{csv}",
        "zh": "把这段 CSV 改写成列和行都相同的 Markdown 表格，每个值都逐字照抄。\n\n{csv}"},
    "fill": {
        "en": "Fill in this template with the data of the record below and return only the filled template.\n\n"
              "Template:\nDear {{name}},\nwe have updated the details of {{company}}: phone {{phone}}, e-mail "
              "{{email}}, address {{address}}.\nKind regards\n\nRecord:\n```json\n{json}\n```",
        "es": "Rellena esta plantilla con los datos del registro de abajo y devuelve solo la plantilla rellenada.\n\n"
              "Plantilla:\nEstimado/a {{name}}:\nhemos actualizado los datos de {{company}}: teléfono {{phone}}, "
              "correo {{email}}, dirección {{address}}.\nUn saludo\n\nRegistro:\n```json\n{json}\n```",
        "it": "Compila questo modello con i dati del record qui sotto e restituisci solo il modello compilato.\n\n"
              "Modello:\nGentile {{name}},\nabbiamo aggiornato i dati di {{company}}: telefono {{phone}}, e-mail "
              "{{email}}, indirizzo {{address}}.\nCordiali saluti\n\nRecord:\n```json\n{json}\n```",
        "zh": "请用下面这条记录的数据填写模板，只返回填好的模板。\n\n模板：\n尊敬的{{name}}：\n我们已更新{{company}}的信息："
              "电话 {{phone}}，邮箱 {{email}}，地址 {{address}}。\n此致\n\n记录：\n```json\n{json}\n```"},
    "entries_csv": {
        "en": "Rewrite this JSON list of translation entries as CSV with the header line id,source,target, quoting "
              "fields that contain commas. Return only the CSV.\n\n```json\n{json}\n```",
        "es": "Reescribe esta lista JSON de entradas de traducción como CSV con la cabecera id,source,target, "
              "entrecomillando los campos que contengan comas. Devuelve solo el CSV.\n\n```json\n{json}\n```",
        "it": "Riscrivi questa lista JSON di voci di traduzione come CSV con l'intestazione id,source,target, "
              "mettendo tra virgolette i campi che contengono virgole. Restituisci solo il CSV.\n\n```json\n{json}\n```",
        "zh": "把这个翻译条目的 JSON 列表改写成 CSV，表头为 id,source,target，含逗号的字段加引号。只返回 CSV。\n\n"
              "```json\n{json}\n```"},
    "rename_keys": {
        "en": "Rename the key \"steps\" to \"solution\" and turn \"answer\" into a number instead of a string; keep "
              "everything else exactly the same. Return the whole JSON.\n\n```json\n{json}\n```",
        "es": "Cambia el nombre de la clave \"steps\" a \"solution\" y convierte \"answer\" en un número en lugar de "
              "una cadena; deja todo lo demás exactamente igual. Devuelve el JSON completo.\n\n```json\n{json}\n```",
        "it": "Rinomina la chiave \"steps\" in \"solution\" e trasforma \"answer\" in un numero invece che in una "
              "stringa; lascia tutto il resto esattamente uguale. Restituisci l'intero JSON.\n\n```json\n{json}\n```",
        "zh": "把键“steps”重命名为“solution”，并把“answer”从字符串改成数字；其他内容保持完全不变。返回完整的 JSON。\n\n"
              "```json\n{json}\n```"},
}
#: Translation directions by the language of the request (the source language).
DIRECTIONS = {"en": ("es", "it", "zh"), "es": ("en", "it"), "it": ("en", "es"), "zh": ("en", "es")}


# --------------------------------------------------------------------------------------------- the builder
class _Builder:
    def __init__(self, src: dict):
        self.src = src
        self.gsm = _Pool(src["gsm8k-train"], f"{SEED}:gsm8k")
        self.he = _Pool(src["humaneval"], f"{SEED}:humaneval")
        self.std = _Pool(src["cpython-stdlib"], f"{SEED}:stdlib")
        self.std_qa = _Pool([r for r in src["cpython-stdlib"] if r["docstring"]], f"{SEED}:stdlib-qa")
        topics = src["pydoc-topics"]
        self.short = _Pool([(k, v) for k, v in sorted(topics.items()) if len(v) < LONG_MIN], f"{SEED}:topics")
        chunks = []
        for k, v in sorted(topics.items()):
            if len(v) >= LONG_MIN:
                chunks += [(f"pydoc-topics/{k}#{i}", c) for i, c in enumerate(_chunks(v))]
        self.chunks = chunks
        self.chunk_pools = {c: _Pool(chunks, f"{SEED}:chunks:{c}") for c in ("summarization", "rag", "context_qa",
                                                                            "extraction")}
        groups: dict[str, list] = {}
        for row in src["django-locale"]:
            groups.setdefault(row["domain"], []).append(row)
        msgs = []
        for dom, rows in sorted(groups.items()):
            for i in range(0, len(rows), 10):
                if len(rows[i: i + 10]) >= 4:
                    msgs.append((f"django-locale/{dom}#{i // 10}", rows[i: i + 10]))
        self.django = _Pool(msgs, f"{SEED}:django")
        self.faker = {lang: _Pool([r for r in src["faker"] if r["language"] == lang], f"{SEED}:faker:{lang}")
                      for lang in LANGUAGES}

    # ------------------------------------------------------------------ one prompt of each kind
    def chat(self, lang: str, k: int):
        u, b = T["chat_user"][lang], T["chat_bot"][lang]
        kind = k % 3
        if kind == 2:
            r = self.faker[lang].next()
            return T["chat_write"][lang].format(**r), "faker", f"faker/{r['id']}"
        if kind == 0:
            r = self.gsm.next()
            steps, final = _clean_gsm8k(r["answer"])
            first = T["chat_math_ask"][lang].format(q=r["question"])
            reply = steps + "\n" + T["chat_answer"][lang].format(a=final)
            follow = T["chat_math_follow"][lang][(k // 3) % 2]
            src, doc = "gsm8k-train", f"gsm8k-train/{r['index']}"
        else:
            r = self.he.next()
            first = T["chat_code_ask"][lang].format(p=r["prompt"])
            reply = f"```python\n{r['prompt']}{r['canonical_solution']}```"
            follow = T["chat_code_follow"][lang][(k // 3) % 2]
            src, doc = "humaneval", r["task_id"]
        text = f"{T['chat_head'][lang]}\n\n{u}: {first}\n\n{b}: {reply}\n\n{u}: {follow}\n\n{T['chat_foot'][lang]}"
        return text, src, doc

    def code(self, lang: str, k: int):
        r = self.he.next()
        key = "code" if k % 2 == 0 else "code2"
        return T[key][lang].format(p=r["prompt"], e=r["entry_point"]), "humaneval", r["task_id"]

    def code_edit(self, lang: str, k: int):
        r = self.std.next()
        ops = ["hints", "docstring", "strip"]
        names = _local_names(r["source"])
        if names:
            ops.append("rename")
        if r["kind"] == "class" and "def __init__" in r["source"]:
            ops.append("dataclass")
        if r["kind"] == "method":
            ops.append("standalone")
        op = ops[k % len(ops)]
        fields = {"m": r["module"]}
        if op == "rename":
            old = names[k % len(names)]
            fields.update(old=old, new=f"{old}_value")
        text = T[op][lang].format(**fields) + f"\n\n```python\n{r['source']}```"
        return text, "cpython-stdlib", f"cpython-stdlib/{r['module']}.{r['qualname']}", {"edit": op}

    def math(self, lang: str, k: int):
        r = self.gsm.next()
        return T["math"][lang].format(q=r["question"]), "gsm8k-train", f"gsm8k-train/{r['index']}"

    def translation(self, lang: str, k: int):
        doc, rows = self.django.next()
        tgt = DIRECTIONS[lang][k % len(DIRECTIONS[lang])]
        items = "\n".join(f"{i}. {row[lang]}" for i, row in enumerate(rows, 1))
        text = T["translation"][lang].format(tgt=NAMES[lang][tgt], items=items)
        return text, "django-locale", doc, {"source_language": lang, "target_language": tgt}

    def summarization(self, lang: str, k: int):
        doc, body = self.chunk_pools["summarization"].next()
        return T["summarization"][lang].format(doc=body), "pydoc-topics", doc

    def rag(self, lang: str, k: int):
        doc, body = self.chunk_pools["rag"].next(lambda c: bool(_terms(c[1])))
        split = split_of("pydoc-topics", doc)
        others = [c for c in self.chunks if c[0].split("#")[0] != doc.split("#")[0]
                  and split_of("pydoc-topics", c[0]) == split]
        rng = random.Random(f"{SEED}:rag:{lang}:{k}:{doc}")
        passages = _passages(body)
        budget = PROMPT_MAX - 450  # room for the instruction, the question and the numbering
        while len(passages) > 2 and sum(len(p) + 6 for p in passages) > budget - 1800:
            passages.pop()  # leave room for two distractors
        main = list(passages)
        for _, other in rng.sample(others, min(2, len(others))):
            first = _passages(other)[0]
            if len(first) > 1200:  # a long distractor: cut at a line break
                first = first[: max(first.rfind("\n", 0, 1200), 600)]
            if sum(len(p) + 6 for p in passages) + len(first) + 6 <= budget:
                passages.append(first)
        terms = _terms("\n".join(main)) or _terms(body)
        term = terms[rng.randrange(len(terms))]
        rng.shuffle(passages)
        text = "\n\n".join(f"[{i}] {p}" for i, p in enumerate(passages, 1))
        return T["rag"][lang].format(passages=text, term=term), "pydoc-topics", doc

    def context_qa(self, lang: str, k: int):
        doc, body = self.chunk_pools["context_qa"].next(lambda c: bool(_terms(c[1])) or "::=" in c[1])
        if "::=" in body and (k % 2 or not _terms(body)):
            question = T["cqa_grammar"][lang]
        else:
            terms = _terms(body)
            question = T["cqa_term"][lang].format(term=terms[random.Random(f"{SEED}:cqa:{doc}:{k}").randrange(
                len(terms))])
        return T["context_qa"][lang].format(doc=body, question=question), "pydoc-topics", doc

    def extraction(self, lang: str, k: int):
        kind = k % 3
        if kind == 0:
            r = self.faker[lang].next()
            note = T["note"][lang].format(**{**r, "address": r["address"].replace("\n", ", ")})
            return T["ext_note"][lang].format(note=note), "faker", f"faker/{r['id']}"
        if kind == 1:
            doc, body = self.chunk_pools["extraction"].next(lambda c: len(_terms(c[1])) >= 3)
            return T["ext_terms"][lang].format(doc=body), "pydoc-topics", doc
        r = self.gsm.next()
        return T["ext_numbers"][lang].format(q=r["question"]), "gsm8k-train", f"gsm8k-train/{r['index']}"

    def qa(self, lang: str, k: int):
        if k % 2 == 0:
            r = self.std_qa.next()
            text = T["qa_func"][lang].format(m=r["module"], q=r["qualname"])
            return text, "cpython-stdlib", f"cpython-stdlib/{r['module']}.{r['qualname']}", \
                {"reference": r["docstring"]}
        name, body = self.short.next()
        heading = body.strip().split("\n")[0].strip()
        return T["qa_topic"][lang].format(h=heading), "pydoc-topics", f"pydoc-topics/{name}"

    def copy_edit(self, lang: str, k: int):
        kind = k % 3
        if kind == 0:
            r = self.faker[lang].next()
            record = {f: r[f] for f in ("name", "company", "address", "city", "phone", "email", "date")}
            op = (k // 3) % 3
            if op == 0:
                other = self.faker[lang].next(lambda o: o["city"] != r["city"])
                text = T["edit_record"][lang].format(city=other["city"], phone=other["phone"],
                                                     json=json.dumps(record, ensure_ascii=False, indent=2))
            elif op == 1:
                text = T["fill"][lang].format(json=json.dumps(record, ensure_ascii=False, indent=2))
            else:
                rows = [r] + [self.faker[lang].next() for _ in range(4)]
                lines = ["name,company,city,phone,email"] + [
                    ",".join(_csv_field(x[f]) for f in ("name", "company", "city", "phone", "email")) for x in rows]
                text = T["csv_table"][lang].format(csv="\n".join(lines))
            return text, "faker", f"faker/{r['id']}", {"edit": ("edit_record", "fill", "csv_table")[op]}
        if kind == 1:
            doc, rows = self.django.next()
            tgt = "en" if lang != "en" else DIRECTIONS["en"][(k // 3) % 3]
            entries = [{"id": i, "source": row[lang], "target": row[tgt]} for i, row in enumerate(rows, 1)]
            text = T["entries_csv"][lang].format(json=json.dumps(entries, ensure_ascii=False, indent=2))
            return text, "django-locale", doc, {"edit": "entries_csv"}
        r = self.gsm.next()
        steps, final = _clean_gsm8k(r["answer"])
        record = {"id": r["index"], "question": r["question"], "steps": steps.split("\n"), "answer": final}
        text = T["rename_keys"][lang].format(json=json.dumps(record, ensure_ascii=False, indent=2))
        return text, "gsm8k-train", f"gsm8k-train/{r['index']}", {"edit": "rename_keys"}


def _csv_field(value: str) -> str:
    value = value.replace("\n", ", ")
    return f'"{value}"' if "," in value or '"' in value else value


def _passages(text: str, size: int = 700) -> list[str]:
    out, cur = [], ""
    for p in text.split("\n\n"):
        cur = f"{cur}\n\n{p}" if cur else p
        if len(cur) >= size:
            out.append(cur)
            cur = ""
    if cur:
        if out:
            out[-1] = f"{out[-1]}\n\n{cur}"
        else:
            out.append(cur)
    return out


def _local_names(source: str) -> list[str]:
    """Parameter and assigned names of a function or class body, in order of first appearance."""
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return []
    seen: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg not in ("self", "cls"):
            seen.setdefault(node.arg, None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            seen.setdefault(node.id, None)
    return [n for n in seen if not n.startswith("_")]


def _round_robin(records: list[dict]) -> list[dict]:
    """Order a split so that its first prompts cover many categories: categories in turn (in the order of
    :data:`CATEGORIES`), and within a category its languages in turn, each category starting at a different
    language so that the first prompts also cover every language."""
    by_cat: dict[str, list[dict]] = {}
    for ci, cat in enumerate(CATEGORIES):
        langs = LANGUAGES[ci % len(LANGUAGES):] + LANGUAGES[: ci % len(LANGUAGES)]
        by_lang = {lang: [r for r in records if r["category"] == cat and r["language"] == lang] for lang in langs}
        seq = []
        for i in range(max((len(v) for v in by_lang.values()), default=0)):
            seq += [v[i] for v in by_lang.values() if i < len(v)]
        by_cat[cat] = seq
    out = []
    for i in range(max(len(v) for v in by_cat.values())):
        out += [v[i] for v in by_cat.values() if i < len(v)]
    return out


def build(sources_dir: str | Path = SOURCES_DIR) -> dict:
    """Build the corpus from the extracts in ``sources_dir``: ``{"description", "sources", "splits"}``, the
    splits :data:`SPLIT_NAMES`, each a list of records (``question_id``, ``category``, ``language``,
    ``turns``, ``source``, ``document`` and, per kind, extra keys such as ``source_language``). The same
    sources give the same corpus on every run.

    Raises:
        CorpusSourceError: a missing or malformed source file (see :func:`read_sources`), or sources too small
            for the corpus's counts.
    """
    src = read_sources(sources_dir)
    b = _Builder(src)
    records = []
    for cat in CATEGORIES:
        for lang, n in zip(LANGUAGES, COUNTS[cat]):
            for k in range(n):
                text, source, doc, *extra = getattr(b, cat)(lang, k)
                if len(text) > PROMPT_MAX:
                    raise CorpusSourceError(f"{doc}: a {cat} prompt of {len(text)} characters (over {PROMPT_MAX}).")
                if cat in LONG_CATEGORIES and len(text) < LONG_MIN:
                    raise CorpusSourceError(f"{doc}: a {cat} prompt of {len(text)} characters (under {LONG_MIN}).")
                rec = {"question_id": f"corpus-{cat}-{lang}-{k + 1:03d}", "category": cat, "language": lang,
                       "turns": [text], "source": source, "document": doc}
                for e in extra:
                    rec.update(e)
                records.append(rec)
    splits = {name: _round_robin([r for r in records if split_of(r["source"], r["document"]) == name])
              for name in SPLIT_NAMES}
    test = splits["corpus_test"]
    if len(test) < 48 or len({r["category"] for r in test}) < 6:
        raise CorpusSourceError("the sources give a test split under 48 prompts or 6 categories.")
    return {"description": DESCRIPTION,
            "sources": {name: {"licence": lic, "file": f, "licence_file": lf}
                        for name, (lic, f, lf) in sorted(SOURCES.items())},
            "loso_source": LOSO_SOURCE, "splits": splits}


DESCRIPTION = (
    "Real-work corpus in the MT-bench / Spec-Bench format (question_id, category, language, turns; the first turn "
    "is the prompt), built by `python -m learn2draft.corpus` from public sources named in "
    "learn2draft/data/corpus_sources/SOURCES.md (GSM8K train, HumanEval, pydoc_data.topics, CPython's standard "
    "library, Django's locale files, Faker's locale providers). Categories: " + ", ".join(CATEGORIES) + "; "
    "languages en, es, it, zh (the request is written in that language; translation prompts are written in their "
    "source language). Each record names its source and document; splits corpus_train / corpus_validation / "
    "corpus_test are disjoint by document (a SHA-256 hash of the document id, about 60/15/25) and ordered "
    "round-robin over categories and languages; corpus_loso holds every prompt of the held-out source "
    f"'{LOSO_SOURCE}', which is in no other split. Spec-Bench's questions and sources (GSM8K test, MT-bench, "
    "WMT14, CNN/DailyMail, Natural Questions, DPR) are not used: they are the confirmation set kept apart.")


def dumps(corpus: dict) -> str:
    """The corpus as the text of its JSON file (UTF-8, indented, a newline at the end)."""
    return json.dumps(corpus, ensure_ascii=False, indent=1) + "\n"


def statistics_of(corpus: dict) -> dict:
    """Counts of a built corpus: per split, category, language and source, characters, and the long share
    (prompts of at least :data:`LONG_MIN` characters)."""
    allrec = [r for rows in corpus["splits"].values() for r in rows]

    def count(key):
        out: dict[str, int] = {}
        for r in allrec:
            out[r[key]] = out.get(r[key], 0) + 1
        return dict(sorted(out.items()))

    chars = [len(r["turns"][0]) for r in allrec]
    return {"total": len(allrec), "splits": {k: len(v) for k, v in corpus["splits"].items()},
            "categories": count("category"), "languages": count("language"), "sources": count("source"),
            "characters": {"total": sum(chars), "min": min(chars), "max": max(chars),
                           "mean": round(sum(chars) / len(chars))},
            "long": sum(c >= LONG_MIN for c in chars)}


def main(argv: list[str] | None = None) -> int:
    """``python -m learn2draft.corpus [--sources DIR] [--out FILE] [--check]``: build the corpus into ``--out``
    (default :data:`CORPUS_FILE`), or with ``--check`` compare ``--out`` with a fresh build. Returns the exit
    status (1: a malformed source, or ``--check`` found a difference)."""
    p = argparse.ArgumentParser(prog="python -m learn2draft.corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", default=str(SOURCES_DIR), help="folder of source extracts (default: shipped)")
    p.add_argument("--out", default=str(CORPUS_FILE), help="corpus file to write or check (default: shipped)")
    p.add_argument("--check", action="store_true", help="verify --out equals a fresh build; write nothing")
    args = p.parse_args(argv)
    try:
        corpus = build(args.sources)
    except CorpusSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = dumps(corpus)
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{out} differs from a fresh build: run python -m learn2draft.corpus to rebuild it.",
                  file=sys.stderr)
            return 1
        print(f"{out} equals a fresh build.")
        return 0
    out.write_text(text, encoding="utf-8")
    print(json.dumps(statistics_of(corpus), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
