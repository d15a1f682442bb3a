"""The tensor index of a GGUF file (`quantization.gguf_index`, issue 35 item 3): the tensors as
`gguf.GGUFReader` gives them (names, types, shapes, the same memory-mapped bytes), read without
building its view of every metadata value (the embedded model's ~100k vocabulary and merges
strings: ~2.4 s of a cold start on 2 cores, AMD EPYC), so packing the weights at a cold start
parses no metadata again; a damaged file is a ValueError naming it, at every cut."""

from __future__ import annotations

import numpy as np
import pytest

from minisgl.testing.modules import require_module

gguf = pytest.importorskip("gguf")


def _index():
    return require_module("minisgl.quantization.gguf_index")


def _same_as_gguf_reader(path) -> None:
    index = _index().read_index(path)
    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for got, ref in zip(index.tensors, reader.tensors, strict=True):
        assert got.tensor_type == ref.tensor_type, got.name
        assert list(got.shape) == [int(x) for x in ref.shape], got.name
        assert got.data.dtype == ref.data.dtype and got.data.shape == ref.data.shape, got.name
        assert np.array_equal(got.data, ref.data), got.name
    arch = reader.fields["general.architecture"]
    assert index.architecture == bytes(arch.parts[arch.data[0]]).decode()


def _write_small(path, alignment: int | None = None) -> None:
    kinds = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_token_list([f"tok{i}" for i in range(300)])  # a string array to skip
    writer.add_token_scores([float(i) for i in range(300)])
    writer.add_uint8("t.u8", 7)
    writer.add_int64("t.i64", -3)
    writer.add_float64("t.f64", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((4, 64)).astype(np.float16))
    raw8 = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), kinds.Q8_0)
    writer.add_tensor("token_embd.weight", raw8, raw_dtype=kinds.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_small_file_indexes_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write_small(path, alignment)
    _same_as_gguf_reader(path)


@pytest.mark.slow
def test_the_embedded_gguf_indexes_as_gguf_reads_it():
    from minisgl.default_model import gguf_path

    _same_as_gguf_reader(gguf_path())


def test_a_damaged_file_is_a_value_error_naming_it_at_every_cut(tmp_path):
    index = _index()
    path = tmp_path / "m.gguf"
    _write_small(path)
    whole = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + whole[4:])
    with pytest.raises(ValueError, match="bad.gguf.*not a GGUF file"):
        index.read_index(bad)
    bad.write_bytes(whole[:4] + (99).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="bad.gguf.*version 99"):
        index.read_index(bad)
    # every cut inside the header, metadata and tensor infos, and one inside the data
    for cut in [*range(0, 1200, 7), len(whole) - 1]:
        bad.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="bad.gguf"):
            index.read_index(bad)


def test_packing_the_weights_parses_no_metadata(tmp_path, monkeypatch):
    """`read_gguf_weights` (the packed cache's build at a cold start) reads the index only."""
    _index()
    from minisgl.quantization.gguf import read_gguf_weights

    path = tmp_path / "m.gguf"
    _write_small(path)

    def refuse(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader parsed the file's metadata")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    got = read_gguf_weights(path, "int4", num_heads=1, num_kv_heads=1)
    assert set(got) == {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"}
