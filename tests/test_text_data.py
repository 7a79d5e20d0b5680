"""Text datasets (`text:SOURCE`): sources, tokenizers, causal blocks, the masked-LM masking the
worker applies, the BPE cache, refusals, and a GPT trained on the shipped corpus end to end."""
from __future__ import annotations

import json
import math
import uuid

import numpy as np
import pytest
import torch

from comm.store_dir import DirectoryStore
from core.errors import ZooidValueError
from core.keys import tokenizer_key
from engine import text_data
from engine.datasets import load_dataset, publish_dataset, read_manifest, read_subsets, validate_dataset
from engine.text_data import (
    BYTE_EOT,
    BYTE_MASK,
    TextInfo,
    TextSettings,
    decode_bytes,
    encode_bytes,
    make_blocks,
    mlm_mask,
    read_corpus,
    stdlib_files,
)

BYTES_MLM = TextInfo(vocab_size=258, objective="mlm", seq_len=128, tokenizer="bytes", eot_id=BYTE_EOT,
                     mask_id=BYTE_MASK)


@pytest.fixture
def corpus_dir(tmp_path):
    """Three documents in a tree (read by sorted relative path) and a hidden file (never read)."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second document\n")
    (root / "a.txt").write_text("first document, ünïcödé\n")
    (root / "sub" / "c.txt").write_text("third\n")
    (root / ".hidden").write_text("never read")
    return root


@pytest.fixture(autouse=True)
def _fresh_memos():
    """Each test starts with no tokenizer or tokenized corpus kept by the process."""
    text_data._BPE.clear()
    text_data._TOKENIZED.clear()
    yield
    text_data._BPE.clear()
    text_data._TOKENIZED.clear()


def _one_line(exc: pytest.ExceptionInfo, field: str) -> str:
    message = str(exc.value)
    assert exc.value.field == field and message.startswith(f"{field}: ") and "\n" not in message, message
    return message


# --- tokenizers ----------------------------------------------------------------------------


def test_the_bytes_tokenizer_round_trips_utf8():
    text = "def f(x):\n    return x  # ünïcödé, 漢字, emoji 🐍\n"
    ids = encode_bytes(text)
    assert ids.dtype == np.int64 and ids.max() < 256 and len(ids) == len(text.encode("utf-8"))
    assert decode_bytes(ids) == text
    assert decode_bytes([*ids[:3], BYTE_EOT, *ids[3:]]) == text  # special ids are not text


def test_documents_are_read_recursively_in_sorted_order_and_joined_with_end_of_text(corpus_dir):
    corpus = read_corpus(f"text:{corpus_dir}")
    assert corpus.documents == ("first document, ünïcödé\n", "second document\n", "third\n")
    assert read_corpus(f"text:file://{corpus_dir}") == corpus  # the same corpus by URL
    assert read_corpus(f"text:{corpus_dir / 'b.txt'}").documents == ("second document\n",)
    stream, info = text_data.tokenize(corpus, TextSettings())
    expected = np.concatenate([np.append(encode_bytes(d), BYTE_EOT) for d in corpus.documents])
    assert np.array_equal(stream, expected) and info.vocab_size == 258 and info.eot_id == 256


def test_the_shipped_corpus_is_the_stdlib_top_level_modules_sorted():
    files = stdlib_files()
    assert files == sorted(files, key=lambda p: p.name) and all(f.suffix == ".py" for f in files)
    assert {"os.py", "functools.py", "typing.py"} <= {f.name for f in files}
    assert 1_000_000 < sum(f.stat().st_size for f in files) < 20_000_000  # a few MB
    small = stdlib_files(kb=100)
    assert small == files[: len(small)] and sum(f.stat().st_size for f in small[:-1]) < 100_000
    assert sum(f.stat().st_size for f in small) >= 100_000
    assert read_corpus("text:stdlib:100").documents == tuple(f.read_text("utf-8") for f in small)


# --- blocks --------------------------------------------------------------------------------


def test_causal_blocks_are_exact_next_token_shifts():
    stream = np.arange(1000) % 251
    x, y = make_blocks(stream, "causal", 16)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (62, 16)  # (1000 - 1) // 16
    flat = torch.from_numpy(stream)
    for i in range(len(x)):
        assert torch.equal(x[i], flat[i * 16:(i + 1) * 16]) and torch.equal(y[i], flat[i * 16 + 1:(i + 1) * 16 + 1])
    mx, my = make_blocks(stream, "mlm", 16)
    assert mx.shape == (62, 16) and torch.equal(mx, my) and torch.equal(mx.reshape(-1), flat[:62 * 16])


def test_a_text_dataset_splits_its_last_tenth_of_blocks_for_validation():
    data = load_dataset("text:stdlib:200", TextSettings(seq_len=32))
    assert data.text == TextInfo(258, "causal", 32, "bytes", 256, 257)
    n = len(data.train_x) + len(data.val_x)
    assert len(data.val_x) == round(n * 0.1) and data.train_x.dtype == data.val_y.dtype == torch.int64
    x, y = torch.cat([data.train_x, data.val_x]), torch.cat([data.train_y, data.val_y])
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:-1, -1], x[1:, 0])  # one token stream
    again = load_dataset("text:stdlib:200", TextSettings(seq_len=32))
    assert torch.equal(again.val_x, data.val_x)  # deterministic


# --- masked LM -----------------------------------------------------------------------------


def _blocks(n: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, length), generator=g)
    x[:, ::37] = BYTE_EOT  # documents end here and there
    return x


def test_mlm_masks_are_the_same_for_the_same_seed_and_differ_across_epochs():
    x = _blocks(64, 128)
    a = mlm_mask(x, BYTES_MLM, seed=3, epoch=0)
    b = mlm_mask(x.clone(), BYTES_MLM, seed=3, epoch=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other_epoch = mlm_mask(x, BYTES_MLM, seed=3, epoch=1)
    other_seed = mlm_mask(x, BYTES_MLM, seed=4, epoch=0)
    assert not torch.equal(a[1] != -100, other_epoch[1] != -100)
    assert not torch.equal(a[1] != -100, other_seed[1] != -100)
    # a sample's mask follows its global index, not the batch it is read in
    head = mlm_mask(x[:40], BYTES_MLM, seed=3, epoch=0, first_index=0)
    tail = mlm_mask(x[40:], BYTES_MLM, seed=3, epoch=0, first_index=40)
    assert torch.equal(torch.cat([head[0], tail[0]]), a[0]) and torch.equal(torch.cat([head[1], tail[1]]), a[1])
    # the validation split's mask is the same in every epoch
    v0, v5 = (mlm_mask(x, BYTES_MLM, seed=3, epoch=e, split="val") for e in (0, 5))
    assert torch.equal(v0[0], v5[0]) and torch.equal(v0[1], v5[1])


def _within(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_mlm_proportions_are_bert_s_within_binomial_bounds():
    x = _blocks(2000, 128, seed=1)
    inputs, targets = mlm_mask(x, BYTES_MLM, seed=0, epoch=2)
    eligible = x != BYTE_EOT
    chosen = targets != -100
    assert not chosen[~eligible].any()  # end-of-text is never chosen
    assert torch.equal(targets[chosen], x[chosen]) and torch.equal(inputs[~chosen], x[~chosen])
    n_eligible, n_chosen = int(eligible.sum()), int(chosen.sum())
    assert _within(n_chosen, n_eligible, 0.15)
    masked = int((inputs[chosen] == BYTE_MASK).sum())
    changed = chosen & (inputs != x) & (inputs != BYTE_MASK)
    assert _within(masked, n_chosen, 0.8)
    # a random token equals the original with probability 1/256: those count as unchanged
    assert _within(int(changed.sum()), n_chosen, 0.1 * 255 / 256)
    assert _within(int((chosen & (inputs == x)).sum()), n_chosen, 0.1 + 0.1 / 256)
    randoms = inputs[changed]
    assert randoms.min() >= 0 and randoms.max() < 256  # never a special id
    assert len(torch.unique(randoms)) > 200  # spread over the vocabulary


def test_random_tokens_skip_special_ids_at_the_start_of_the_vocabulary():
    info = TextInfo(vocab_size=10, objective="mlm", seq_len=64, tokenizer="bpe:10", eot_id=0, mask_id=1)
    x = torch.randint(2, 10, (500, 64), generator=torch.Generator().manual_seed(0))
    inputs, targets = mlm_mask(x, info, seed=0, epoch=0)
    changed = (targets != -100) & (inputs != x) & (inputs != 1)
    assert changed.any() and set(inputs[changed].tolist()) <= set(range(2, 10))


def test_a_short_sample_gets_one_target_at_least():
    x = torch.tensor([[65, 66, BYTE_EOT, 67]] * 300)
    _, targets = mlm_mask(x, BYTES_MLM, seed=0, epoch=0)
    assert ((targets != -100).sum(1) >= 1).all() and not (targets[:, 2] != -100).any()


def test_workers_read_the_same_masks_whichever_subsets_they_read(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    manifest = publish_dataset(store, "r1", "text:stdlib:120", subset_size=16,
                               text=TextSettings(objective="mlm", seq_len=64))
    assert manifest.text == TextInfo(258, "mlm", 64, "bytes", 256, 257) and manifest.input_shape == (64,)
    assert read_manifest(store, "r1") == manifest
    whole = read_subsets(store, "r1", [2, 3, 4], seed=7, epoch=1)
    parts = [read_subsets(store, "r1", [i], seed=7, epoch=1) for i in (2, 3, 4)]
    assert whole[0].dtype == whole[1].dtype == torch.int64 and whole[0].shape == (48, 64)
    assert torch.equal(whole[0], torch.cat([p[0] for p in parts]))
    assert torch.equal(whole[1], torch.cat([p[1] for p in parts]))
    assert (whole[0] == BYTE_MASK).any() and ((whole[1] != -100).float().mean() - 0.15).abs() < 0.03
    assert not torch.equal(whole[1], read_subsets(store, "r1", [2, 3, 4], seed=7, epoch=2)[1])
    val = [read_subsets(store, "r1", range(manifest.n_val_subsets), split="val", seed=7, epoch=e) for e in (0, 3)]
    assert torch.equal(val[0][0], val[1][0]) and torch.equal(val[0][1], val[1][1])
    # causal subsets come back as they were loaded, as int64
    causal = publish_dataset(store, "r2", "text:stdlib:120", subset_size=16, text=TextSettings(seq_len=64))
    data = load_dataset("text:stdlib:120", TextSettings(seq_len=64))
    x, y = read_subsets(store, "r2", range(causal.n_subsets))
    assert torch.equal(x, data.train_x) and torch.equal(y, data.train_y) and x.dtype == torch.int64


# --- BPE -----------------------------------------------------------------------------------


def test_bpe_trains_offline_deterministically_and_is_cached_in_the_durable_store(tmp_path, monkeypatch):
    store = DirectoryStore(tmp_path / "store")
    settings = TextSettings(tokenizer="bpe:400", seq_len=32)
    trained = []
    train = text_data.train_bpe
    monkeypatch.setattr(text_data, "train_bpe", lambda docs, size: trained.append(size) or train(docs, size))
    first = load_dataset("text:stdlib:100", settings, cache=store)
    corpus = read_corpus("text:stdlib:100")
    key = tokenizer_key(corpus.sha256, "bpe400-bytelevel-v1")
    assert trained == [400] and store.exists(key)
    tok_json = json.loads(store.get(key))  # the tokenizer's JSON text, never a pickle
    assert tok_json["model"]["type"] == "BPE" and len(tok_json["model"]["vocab"]) == 400
    info = first.text
    assert (info.vocab_size, info.eot_id, info.mask_id, info.tokenizer) == (400, 0, 1, "bpe:400")
    assert int(first.train_x.max()) < 400 and int((first.train_x == 0).sum()) > 0  # documents end
    # BPE packs the text: fewer tokens than bytes
    assert len(first.train_x) < 0.6 * len(load_dataset("text:stdlib:100", TextSettings(seq_len=32)).train_x)
    # a second run (a fresh process: nothing kept in memory) reads the cache and trains nothing
    text_data._BPE.clear()
    text_data._TOKENIZED.clear()
    second = load_dataset("text:stdlib:100", settings, cache=store)
    assert trained == [400] and torch.equal(second.train_x, first.train_x)
    # training again from scratch gives the same vocabulary, byte for byte
    assert train(corpus.documents, 400).to_str() == store.get(key).decode("utf-8")


def test_the_coordinator_caches_the_job_s_tokenizer_in_its_durable_store(tmp_path):
    from coordinator.run.job import TrainJob
    from coordinator.run.job_data import load_job_dataset, text_settings

    job = TrainJob(dataset="text:stdlib:60", tokenizer="bpe:300", objective="mlm", seq_len=32,
                   durable_store=f"file://{tmp_path}/durable")
    assert text_settings(job) == TextSettings("bpe:300", "mlm", 32)
    data = load_job_dataset(job, f"file://{tmp_path}/durable")
    assert data.text.mask_id == 1 and data.text.objective == "mlm"
    keys = DirectoryStore(tmp_path / "durable").list("cache/tokenizers/")
    assert keys == [tokenizer_key(read_corpus("text:stdlib:60").sha256, "bpe300-bytelevel-v1")]


# --- remote sources --------------------------------------------------------------------------


def test_a_corpus_is_read_from_s3_below_its_prefix(s3_server):
    bucket = s3_server.create_bucket(f"corpus-{uuid.uuid4().hex[:8]}")
    client = s3_server.client()
    for key, text in (("texts/b/2.txt", "two\n"), ("texts/a.txt", "one\n"), ("other/x.txt", "not this\n")):
        client.put_object(Bucket=bucket, Key=key, Body=text.encode())
    corpus = read_corpus(f"text:s3://{bucket}/texts?endpoint={s3_server.endpoint}")
    assert corpus.documents == ("one\n", "two\n")
    data = load_dataset(f"text:s3://{bucket}/texts?endpoint={s3_server.endpoint}", TextSettings(seq_len=2))
    stream = [*b"one\n", 256, *b"two\n", 256]  # 10 tokens: 4 blocks of 2 with their next tokens
    assert torch.cat([data.train_x, data.val_x]).reshape(-1).tolist() == stream[:8]
    assert torch.cat([data.train_y, data.val_y]).reshape(-1).tolist() == stream[1:9]
    with pytest.raises(ZooidValueError) as exc:
        read_corpus(f"text:s3://{bucket}/nothing-here?endpoint={s3_server.endpoint}")
    assert "the corpus is empty" in _one_line(exc, "dataset")


def test_a_corpus_is_read_from_azure_blob_storage(azurite, monkeypatch):
    container = azurite.create_container(f"corpus-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    from comm.store import open_store

    with open_store(f"az://{container}/texts") as store:
        store.put("doc-1.txt", b"hello\n")
        store.put("doc-2.txt", "w\u00f6rld\n".encode())
    assert read_corpus(f"text:az://{container}/texts").documents == ("hello\n", "w\u00f6rld\n")


def test_a_store_block_source_is_opened_by_the_caller_s_opener(tmp_path):
    store = DirectoryStore(tmp_path / "blob")
    store.put("one.txt", b"alpha\n")
    opened = []

    def opener(ref: str):
        opened.append(ref)
        return DirectoryStore(tmp_path / "blob")

    assert read_corpus("text:block:zooid-store/corpus", opener).documents == ("alpha\n",)
    assert opened == ["block:zooid-store/corpus"]
    with pytest.raises(ZooidValueError) as exc:
        read_corpus("text:block:zooid-store/corpus")  # the worker side cannot load a block
    assert "opened by the coordinator" in _one_line(exc, "dataset")


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, settings, field, words", [
    ("text:/no/such/corpus", None, "dataset", "no such file or directory"),
    ("text:", None, "dataset", "is not text:SOURCE"),
    ("text:ftp://host/x", None, "dataset", "unknown scheme 'ftp'"),
    ("text:stdlib:lots", None, "dataset", "KB is a positive integer"),
    ("text:stdlib", TextSettings(tokenizer="wordpiece"), "tokenizer", "is not `bytes` or `bpe:<vocab size>`"),
    ("text:stdlib", TextSettings(tokenizer="bpe:abc"), "tokenizer", "integer from 258"),
    ("text:stdlib", TextSettings(tokenizer="bpe:100"), "tokenizer", "integer from 258"),
    ("text:stdlib", TextSettings(objective="prefix"), "objective", "causal, mlm"),
    ("text:stdlib", TextSettings(seq_len=1), "seq_len", "at least 2"),
    ("digits", TextSettings(objective="mlm"), "objective", "is for text: datasets"),
    ("synthetic:64", TextSettings(tokenizer="bpe:1000"), "tokenizer", "is for text: datasets"),
])
def test_bad_text_input_is_refused_in_one_line_naming_the_field(name, settings, field, words):
    with pytest.raises(ZooidValueError) as exc:
        validate_dataset(name, settings)
    assert words in _one_line(exc, field)


def test_an_empty_or_undecodable_corpus_and_too_long_blocks_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    with pytest.raises(ZooidValueError) as exc:
        validate_dataset(f"text:{empty}")
    assert "the corpus is empty" in _one_line(exc, "dataset")
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ZooidValueError) as exc:
        load_dataset(f"text:{binary}")
    assert "img.png is not UTF-8 text" in _one_line(exc, "dataset")
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ZooidValueError) as exc:
        load_dataset(f"text:{short}", TextSettings(seq_len=64))
    assert "fewer than 2 blocks" in _one_line(exc, "seq_len")


# --- end to end ----------------------------------------------------------------------------


@pytest.mark.usefixtures("prefect_api")
def test_a_gpt_trains_on_the_shipped_corpus_from_the_command_line(tmp_path, capsys):
    from flows.train import main

    out = tmp_path / "summary.json"
    params = ["model=gpt_mini", "dataset=text:stdlib:100", "seq_len=32", "epochs=2", "workers=2",
              "batch_size=16", "optimizer=adam", "lr=0.003", "strategy=local_sgd", f"store=file://{tmp_path}/store"]
    assert main([a for p in params for a in ("--param", p)] + ["--summary-out", str(out)]) == 0
    summary = json.loads(out.read_text())
    epochs = summary["epochs"]
    assert summary["status"] == "completed" and len(epochs) == 2
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"] < math.log(258)  # below uniform over bytes
    assert epochs[1]["val_loss"] < epochs[0]["val_loss"]


@pytest.mark.usefixtures("prefect_api")
def test_a_missing_corpus_is_refused_before_anything_is_rented(tmp_path, capsys):
    from flows.train import main

    store = tmp_path / "store"
    argv = ["--param", "model=gpt_mini", "--param", f"dataset=text:{tmp_path}/nothing",
            "--param", f"store=file://{store}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: dataset: ") and "no such file" in err[0], err
    assert not (store / "runs").exists()
