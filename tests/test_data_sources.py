"""Sources of text data: sentence splitter, synthetic corpus, files, JSONL, Hugging Face datasets."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poslab.data.config import DataConfig
from poslab.data.sentences import segment, split_paragraphs, split_sentences
from poslab.data.sources import HFSource, JsonlSource, TextSource, document_text, open_source
from poslab.data.synthetic import PARAGRAPH_CUES, SENTENCE_CUES, SyntheticCorpus
from poslab.errors import ConfigError, DataError

# -- sentence splitter ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Mr. Smith went to Washington. He left.", ["Mr. Smith went to Washington.", "He left."]),
    ("It cost $3.14 today. Prices rose 2.5% in Jan. 2020.", ["It cost $3.14 today.", "Prices rose 2.5% in Jan. 2020."]),
    ("Wait... and then it ended. Really?! Yes.", ["Wait... and then it ended.", "Really?!", "Yes."]),
    ("He paused... Then he spoke.", ["He paused...", "Then he spoke."]),
    ('"Stop!" he said. "Why?" She asked.', ['"Stop!" he said.', '"Why?"', "She asked."]),
    ('It was "great." Next came more.', ['It was "great."', "Next came more."]),
    ("J. R. R. Tolkien wrote e.g. books. See Fig. 3 now.", ["J. R. R. Tolkien wrote e.g. books.", "See Fig. 3 now."]),
    ("Visit example.com today. Version 1.2.3 works.", ["Visit example.com today.", "Version 1.2.3 works."]),
    ("It ended (finally.) Then more.", ["It ended (finally.)", "Then more."]),
    ("東京に行った。大阪にも行った。 Then home.", ["東京に行った。", "大阪にも行った。", "Then home."]),
    ("A line\nwrapped mid sentence. Next.", ["A line wrapped mid sentence.", "Next."]),
    ("The vote was 5 to 4. 10 members abstained.", ["The vote was 5 to 4.", "10 members abstained."]),
    ('He paused. ("well," she said.) Then more.', ['He paused. ("well," she said.)', "Then more."]),
    ("Odd\u00a0spaces.\u2003Next\u3000one.  Then\tmore.", ["Odd spaces.", "Next one.", "Then more."]),
])
def test_sentence_splitter(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize("text, expected", [
    # Known failure cases, pinned so that a change of behaviour is deliberate (see sentences.py).
    ("He lives in the U.S. Then he moved.", ["He lives in the U.S. Then he moved."]),
    ("Sales rose. iPhone sales fell.", ["Sales rose. iPhone sales fell."]),
    ("Ask Brig. Smith now.", ["Ask Brig.", "Smith now."]),
])
def test_sentence_splitter_known_failures(text, expected):
    assert split_sentences(text) == expected


def test_paragraphs_at_blank_lines():
    text = "First para. Two.\n\n\nSecond para.\n  \nThird\nstill third.\n"
    assert split_paragraphs(text) == ["First para. Two.", "Second para.", "Third\nstill third."]
    assert segment(text) == [["First para.", "Two."], ["Second para."], ["Third still third."]]
    assert split_paragraphs("\n\n  \nOnly one.\n\n\n") == ["Only one."]  # no empty paragraph at either end


_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=2, max_size=8)
_sentence = st.builds(lambda first, rest, mark: " ".join([first.capitalize()] + rest) + mark,
                      _word, st.lists(_word, max_size=8), st.sampled_from([".", "!", "?", "...", "?!"]))


@given(st.lists(st.lists(_sentence, min_size=1, max_size=5), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_segment_recovers_generated_structure(doc):
    """Capitalised sentences ending in . ! ? or ... (words not abbreviations) are recovered exactly."""
    from poslab.data.sentences import ABBREVIATIONS

    if any(w.lower() in ABBREVIATIONS or len(w) == 1 for p in doc for s in p for w in s.rstrip(".!?").split()):
        return
    assert segment(document_text(doc)[0]) == doc


# -- synthetic corpus ----------------------------------------------------------------------------------


def test_synthetic_lengths_and_determinism():
    corpus = SyntheticCorpus(documents=50, seed=3, paragraphs=[2, 4], sentences=[1, 3])
    docs = list(corpus.documents())
    assert len(docs) == 50
    assert all(2 <= len(d) <= 4 and all(1 <= len(p) <= 3 for p in d) for d in docs)
    assert {len(d) for d in docs} == {2, 3, 4}
    # Document i does not depend on how many documents are asked for; the seed changes it.
    assert SyntheticCorpus(documents=5, seed=3, paragraphs=[2, 4], sentences=[1, 3]).document(4) == docs[4]
    assert SyntheticCorpus(documents=5, seed=4).document(4) != SyntheticCorpus(documents=5, seed=3).document(4)


def test_synthetic_structure_cues():
    corpus = SyntheticCorpus(documents=200, cue_prob=1.0, question_prob=0.0)
    for doc in corpus.documents():
        for p, paragraph in enumerate(doc):
            where = "first" if p == 0 else "last" if p == len(doc) - 1 else "middle"
            for s, sentence in enumerate(paragraph):
                opener = sentence.split(",")[0].lower()
                expected = PARAGRAPH_CUES[where] if s == 0 else SENTENCE_CUES[min(s, 3) - 1]
                assert opener in expected, (sentence, where, s)
                assert sentence[0].isupper() and sentence.endswith("!" if s == len(paragraph) - 1 else ".")


def test_synthetic_topics_change_between_paragraphs():
    corpus = SyntheticCorpus(documents=100, topic_prob=1.0)
    topic_of = {w: t for t, words in enumerate(corpus.lexicon.topic_nouns) for w in words}
    changes = 0
    for doc in corpus.documents():
        topics = []
        for paragraph in doc:
            words = {w.strip(",.?!").lower().removesuffix("s") for s in paragraph for w in s.split()}
            found = {topic_of[w] for w in words if w in topic_of}
            assert len(found) == 1  # every noun of the paragraph comes from its single topic
            topics.append(found.pop())
        changes += sum(a != b for a, b in zip(topics, topics[1:]))
        assert all(a != b for a, b in zip(topics, topics[1:]))
    assert changes > 100


def test_synthetic_text_segments_back_exactly():
    """Rendered as text, the synthetic corpus is split by the real-text splitter into its exact sentences."""
    for doc in SyntheticCorpus(documents=30).documents():
        assert segment(document_text(doc)[0]) == doc


def test_synthetic_bad_options():
    with pytest.raises(ConfigError, match="did you mean 'sentences'"):
        SyntheticCorpus(sentence=[1, 2])
    with pytest.raises(ConfigError, match="paragraphs"):
        SyntheticCorpus(paragraphs=[3, 1])


# -- files, JSONL, Hugging Face --------------------------------------------------------------------------


def test_text_source_files_directories_and_separators(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("One. Two.\n\nThree.\n")
    (tmp_path / "d" / "sub" / "b.txt").write_text("Four.\n<doc>\nFive. Six.\n")
    (tmp_path / "d" / "skip.md").write_text("Not read.")
    docs = list(TextSource(paths=str(tmp_path / "d")).documents())
    assert docs == [[["One.", "Two."], ["Three."]], [["Four.", "<doc> Five.", "Six."]]]
    docs = list(TextSource(paths=[str(tmp_path / "d")], doc_separator="<doc>", max_documents=2).documents())
    assert docs == [[["One.", "Two."], ["Three."]], [["Four."]]]
    (tmp_path / "e.txt").write_text("Alpha one.\n<doc>\nBeta two.\n\nGamma three.\n <doc> \nDelta four.\n")
    docs = list(TextSource(paths=str(tmp_path / "e.txt"), doc_separator="<doc>").documents())
    assert docs == [[["Alpha one."]], [["Beta two."], ["Gamma three."]], [["Delta four."]]]  # each its own text


def test_missing_files_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        TextSource(paths=str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="no files matching"):
        JsonlSource(paths=str(tmp_path))


def test_invalid_utf8_replaced_and_counted(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes("Caf\u00e9 ok. ".encode() + b"Bad \xff\xfe bytes. Fine \xe2\x82 end.\n")
    source = TextSource(paths=str(path))
    docs = list(source.documents())
    assert source.invalid_utf8 == 4
    assert docs == [[["Café ok.", "Bad \ufffd\ufffd bytes.", "Fine \ufffd\ufffd end."]]]
    list(source.documents())  # a second pass counts afresh
    assert source.invalid_utf8 == 4


def test_invalid_bytes_are_counted_only_in_the_documents_read(tmp_path):
    """max_documents stopped after reading one document more, whose invalid bytes were counted (and warned of)
    though it was never prepared."""
    (tmp_path / "a.txt").write_bytes(b"Fine text. All valid.\n")
    (tmp_path / "b.txt").write_bytes(b"Bad \xff\xfe bytes.\n")
    source = TextSource(paths=str(tmp_path), max_documents=1)
    assert list(source.documents()) == [[["Fine text.", "All valid."]]] and source.invalid_utf8 == 0


def test_jsonl_source(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(["Ab cd. Ef gh.", "Ij.\n\nKl."])) + "\n")
    assert list(JsonlSource(paths=str(path), text_field="body").documents()) == [[["Ab cd.", "Ef gh."]], [["Ij."], ["Kl."]]]
    with pytest.raises(DataError, match="no string field 'text'"):
        list(JsonlSource(paths=str(path)).documents())
    path.write_text('{"text": "ok."}\n{broken\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: invalid JSON"):
        list(JsonlSource(paths=str(path)).documents())


def test_jsonl_unpaired_surrogates_replaced_and_counted(tmp_path):
    """JSON can spell text that is not Unicode: an unpaired surrogate escape (an emoji cut in half by a
    crawler's truncation). It is invalid text like an invalid byte, and the tokenizer cannot encode it
    (preparation died with a UnicodeEncodeError traceback)."""
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"text": "Cut \ud83d here. Whole \ud83d\ude00 pair. Low \udc00 too."}) + "\n")
    source = JsonlSource(paths=str(path))
    assert list(source.documents()) == [[["Cut \ufffd here.", "Whole \U0001f600 pair.", "Low \ufffd too."]]]
    assert source.invalid_utf8 == 2


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_source_on_local_files(tmp_path, streaming):
    """The Hugging Face loader reads a local JSON file through the packaged 'json' builder (no network)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"content": f"Doc {i} here. Second {i}."}) for i in range(5)) + "\n")
    source = HFSource(name="json", data_files=str(path), streaming=streaming, text_field="content", max_documents=3)
    assert list(source.documents()) == [[[f"Doc {i} here.", f"Second {i}."]] for i in range(3)]


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_source_unreadable_rows_are_one_line(tmp_path, streaming):
    """A row the loader cannot parse fails while the rows are read (streaming) or inside datasets' own
    wrapper exception (not streaming): both were tracebacks, not the one-line error of bad input."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "Fine row."}) + "\n" + '{"text": "Cut \\ud83d here."}\n')
    with pytest.raises(DataError, match="Hugging Face dataset 'json'.*JSON parse error: The surrogate pair"):
        list(HFSource(name="json", data_files=str(path), streaming=streaming).documents())


def test_hf_source_local_directory_and_errors(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text(json.dumps({"text": "Hello there. Bye."}) + "\n")
    assert list(HFSource(name=str(tmp_path / "ds")).documents()) == [[["Hello there.", "Bye."]]]
    with pytest.raises(DataError, match="no string field 'body'"):
        list(HFSource(name=str(tmp_path / "ds"), text_field="body").documents())
    with pytest.raises(DataError, match="cannot load Hugging Face dataset"):
        list(HFSource(name="json", data_files=str(tmp_path / "missing.jsonl")).documents())


def test_hf_source_unreachable_is_one_line_without_the_hub_s_retries(monkeypatch, caplog):
    """Offline, huggingface_hub logged a warning per retry (eleven lines) before the one-line error."""
    import logging

    import datasets

    def offline(*args, **kwargs):
        for attempt in range(1, 6):
            logging.getLogger("huggingface_hub.utils._http").warning(f"Retrying in 1s [Retry {attempt}/5].")
        raise OSError("Couldn't reach 'org/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    level = logging.getLogger("huggingface_hub").level
    with pytest.raises(DataError, match="^cannot load Hugging Face dataset 'org/corpus': Couldn't reach"):
        list(HFSource(name="org/corpus").documents())
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]
    assert logging.getLogger("huggingface_hub").level == level  # restored


def _hub_cache_with(tmp_path, repo: str, rows: list[dict]) -> str:
    """A datasets cache holding ``repo`` as a download from the hub leaves it (built here from a local file)."""
    import datasets

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets.load_dataset("json", data_files=str(tmp_path / "rows.jsonl"), split="train",
                          cache_dir=str(tmp_path / "build"))
    built = next(p for p in (tmp_path / "build" / "json").glob("*/*/*") if p.is_dir())
    cached = tmp_path / "cache" / repo.replace("/", "___") / "default" / "0.0.0" / built.name
    shutil.copytree(built, cached)
    (cached / "json-train.arrow").rename(cached / f"{repo.split('/')[-1]}-train.arrow")
    return str(tmp_path / "cache")


@pytest.mark.parametrize("network", ["no name resolution", "proxy", "resolves"])
def test_hf_source_reads_the_cache_at_once_where_the_hub_cannot_be_reached(network, tmp_path, monkeypatch):
    """Offline without HF_HUB_OFFLINE a hub dataset waited 25 s for the hub client's retries, then fell back to
    its cached copy or failed. Where the hub's name does not resolve both clients now go offline for the load:
    the cached copy is read at once, a missing one fails at once with one line; behind a proxy, or where the
    name resolves, the hub is asked as before. Offline mode is on only during the load."""
    import socket

    import datasets
    import huggingface_hub

    from poslab.data import sources

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", _hub_cache_with(tmp_path, "org/corpus", [
        {"text": "Cached here. Read offline."}]))

    def lookup(host, port, *args):
        if network == "no name resolution":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", port))]

    monkeypatch.setattr(sources.socket, "getaddrinfo", lookup)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.example.org")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for name in sources.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if network == "proxy":
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.org:3128")
    load, modes = datasets.load_dataset, []

    def spy(name, *args, **kwargs):
        modes.append((datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE))
        if network != "no name resolution":  # the client would ask the hub: answer as an unreachable one does
            raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")
        return load(name, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    offline = network == "no name resolution"
    if offline:
        assert list(HFSource(name="org/corpus").documents()) == [[["Cached here.", "Read offline."]]]
    with pytest.raises(DataError) as err:
        list(HFSource(name="org/missing").documents())
    assert modes == [(offline, offline)] * (1 + offline)
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == (False, False)
    if offline:
        assert str(err.value) == ("cannot load Hugging Face dataset 'org/missing': not in the Hugging Face cache, "
                                  "and the hub (hub.example.org) cannot be reached: its name does not resolve; fetch "
                                  "it where there is internet")
    else:
        assert str(err.value) == ("cannot load Hugging Face dataset 'org/missing': Couldn't reach 'org/missing' on "
                                  "the Hub (LocalEntryNotFoundError)")


@pytest.mark.parametrize("source,message", [
    ({"type": "text", "paths": "x", "glob": 5}, "text source glob must be a string, got 5"),
    ({"type": "text", "paths": "x", "doc_separator": 5}, "text source doc_separator must be a string or null"),
    ({"type": "jsonl", "paths": "x", "text_field": ["a"]}, "jsonl source text_field must be a string"),
    ({"type": "hf", "name": "json", "streaming": "maybe"}, "hf source streaming must be true or false"),
    ({"type": "hf", "name": "json", "data_files": {"train": 5}}, "hf source data_files must be a path, a list"),
    ({"type": "hf", "name": "json", "data_files": []}, "hf source data_files must be a path, a list"),
])
def test_source_options_of_the_wrong_type_are_one_line(source, message):
    """Were tracebacks (glob 5: 'int' object is not subscriptable) or silently kept (streaming 'maybe')."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        open_source(source)


def test_hf_source_names_its_local_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "ds" / name).write_text(json.dumps({"text": "Hi."}) + "\n")
    builder = HFSource(name="json", data_files={"train": ["ds/*.jsonl"]})
    assert builder.local_paths == [str(tmp_path / "ds" / "*.jsonl")]
    assert builder.files == [tmp_path / "ds" / "a.jsonl", tmp_path / "ds" / "b.jsonl"]
    assert HFSource(name="ds").files == builder.files  # a local dataset directory
    assert HFSource(name="ds", data_files="a.jsonl").files == [tmp_path / "ds" / "a.jsonl"]
    (tmp_path / "ds" / "sub").mkdir()
    (tmp_path / "ds" / "sub" / "c.jsonl").write_text(json.dumps({"text": "Hi."}) + "\n")
    within = HFSource(name="ds", data_dir="sub", data_files="c.jsonl")  # load_dataset reads ds/sub/c.jsonl
    assert within.files == [tmp_path / "ds" / "sub" / "c.jsonl"] and len(list(within.documents())) == 1
    hub = HFSource(name="HuggingFaceFW/fineweb", data_files="data/*.parquet")
    assert hub.local_paths == [] and hub.files == []
    assert HFSource(name="json", data_files=["https://example.org/c.jsonl", "ds/a.jsonl"]).local_paths == \
        [str(tmp_path / "ds" / "a.jsonl")]  # a URL is no local path, wherever the command runs
    with pytest.raises(DataError, match="no local file matches"):
        HFSource(name="json", data_files="gone.jsonl").files


def test_source_config_validation():
    with pytest.raises(ConfigError, match="did you mean 'jsonl'"):
        open_source({"type": "jsonl_", "paths": "x"})
    with pytest.raises(ConfigError, match="did you mean 'text_field'"):
        DataConfig.from_options({"source": {"type": "jsonl", "paths": "x", "textfield": "t"}})
    with pytest.raises(ConfigError, match="exactly one of"):
        DataConfig.from_options({})
