"""The RecordIO format (facepipe.io.insightface_rec) against hand-built bytes: framing, continuation, IRHeader."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from facepipe.io.insightface_rec import (
    MAGIC,
    IRHeader,
    RecordIOError,
    RecordIOWriter,
    frame,
    pack,
    read_index,
    read_property,
    read_record,
    scan_offsets,
    unpack,
)

M = struct.pack("<I", MAGIC)


def lrec(flag: int, length: int) -> bytes:
    return struct.pack("<I", (flag << 29) | length)


def test_magic_word_is_dmlc_s():
    assert M == bytes([0x0A, 0x23, 0xD7, 0xCE])


def test_a_whole_record_is_magic_length_data_and_padding():
    assert frame(b"abcde") == M + lrec(0, 5) + b"abcde" + b"\0\0\0"
    assert frame(b"abcd") == M + lrec(0, 4) + b"abcd"
    assert frame(b"") == M + lrec(0, 0)


def test_aligned_magic_words_split_a_record_into_parts():
    # dmlc's writer drops each 4-aligned magic word and flags the parts first (1), middle (2), last (3)
    data = M + b"abcd" + M + b"z"
    assert frame(data) == M + lrec(1, 0) + M + lrec(2, 4) + b"abcd" + M + lrec(3, 1) + b"z\0\0\0"
    two = b"AAAA" + M + b"BB"
    assert frame(two) == M + lrec(1, 4) + b"AAAA" + M + lrec(3, 2) + b"BB\0\0"
    unaligned = b"A" + M + b"BCD"  # not on a 4-byte boundary: stays in one part
    assert frame(unaligned) == M + lrec(0, 8) + unaligned


@pytest.mark.parametrize("data", [b"", b"x", b"abcd", M, M + M, b"AAAA" + M + b"BB", b"q" * 13 + M + b"A" + M * 3 + b"tail"])
def test_parts_join_back_to_the_record(tmp_path, data):
    path = tmp_path / "r.rec"
    path.write_bytes(frame(data) + frame(b"next"))
    with open(path, "rb") as handle:
        assert read_record(handle, 0) == data
        assert read_record(handle, handle.tell()) == b"next"


def test_irheader_float_label_layout_and_round_trip():
    data = pack(IRHeader(0, 7.0, 12, 0), b"JPEG")
    assert data == struct.pack("<IfQQ", 0, 7.0, 12, 0) + b"JPEG"
    assert len(data) == 24 + 4
    header, payload = unpack(data)
    assert header == IRHeader(0, 7.0, 12, 0) and header.first_label == 7.0 and payload == b"JPEG"


def test_irheader_array_label_sets_flag_and_follows_the_header():
    data = pack(IRHeader(99, (3.0, 0.5, 2.0), 4, 1), b"img")
    assert data == struct.pack("<IfQQ", 3, 0.0, 4, 1) + struct.pack("<3f", 3.0, 0.5, 2.0) + b"img"
    header, payload = unpack(data)
    assert header.flag == 3 and header.label == (3.0, 0.5, 2.0) and header.first_label == 3.0
    assert payload == b"img"


def test_unpack_refuses_short_records():
    with pytest.raises(RecordIOError, match="shorter than its 24-byte IRHeader"):
        unpack(b"\0" * 23)
    with pytest.raises(RecordIOError, match="flag 5 promises 5 labels"):
        unpack(struct.pack("<IfQQ", 5, 0.0, 0, 0) + b"\0" * 8)


def test_writer_index_and_reader_round_trip(tmp_path):
    records = {0: b"header", 1: b"a" * 10, 2: M + b"with magic", 3: b""}
    with RecordIOWriter(tmp_path / "t.rec", tmp_path / "t.idx") as writer:
        for key, data in records.items():
            writer.write(key, data)
    index = read_index(tmp_path / "t.idx")
    assert [key for key, _ in index] == [0, 1, 2, 3]
    assert (tmp_path / "t.idx").read_text().splitlines()[1] == f"1\t{len(frame(b'header'))}"
    with open(tmp_path / "t.rec", "rb") as handle:
        assert {key: read_record(handle, offset) for key, offset in index} == records
    assert list(scan_offsets(tmp_path / "t.rec")) == [offset for _, offset in index]


def test_truncated_last_record_is_named_and_the_others_read(tmp_path):
    with RecordIOWriter(tmp_path / "t.rec", tmp_path / "t.idx") as writer:
        writer.write(0, b"first record")
        writer.write(1, b"A" * 8 + M + b"B" * 40)  # two parts: the cut falls in the second
    rec = tmp_path / "t.rec"
    rec.write_bytes(rec.read_bytes()[:-10])
    index = read_index(tmp_path / "t.idx")
    with open(rec, "rb") as handle:
        assert read_record(handle, index[0][1]) == b"first record"
        with pytest.raises(RecordIOError, match="file ends") as error:
            read_record(handle, index[1][1])
    assert error.value.truncated
    assert list(scan_offsets(rec)) == [offset for _, offset in index]  # the bad one is yielded, then it stops


def test_garbage_is_not_truncation(tmp_path):
    rec = tmp_path / "t.rec"
    rec.write_bytes(b"\1\2\3\4" + lrec(0, 4) + b"data")
    with open(rec, "rb") as handle, pytest.raises(RecordIOError, match="bad magic 0x04030201") as error:
        read_record(handle, 0)
    assert not error.value.truncated
    rec.write_bytes(M + lrec(3, 4) + b"data")  # a last part with no first one
    with open(rec, "rb") as handle, pytest.raises(RecordIOError, match="continuation flag 3 out of sequence"):
        read_record(handle, 0)


def test_index_lines_must_be_key_and_offset(tmp_path):
    idx = tmp_path / "t.idx"
    idx.write_text("0\t0\n1\tforty\n")
    with pytest.raises(RecordIOError, match="line 2 is not 'key<TAB>offset'"):
        read_index(idx)


def test_a_part_longer_than_the_file_is_truncated_before_it_is_read(tmp_path):
    path = tmp_path / "r.rec"
    path.write_bytes(M + lrec(0, (1 << 29) - 1) + b"abcd")  # a 512 MiB part in a 12-byte file
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^file ends 536870907 bytes short of the part at offset 0$") as error:
        read_record(handle, 0)
    assert error.value.truncated
    path.write_bytes(b"pad." + frame(b"abcde")[:-3])  # the last part without its padding: exactly enough
    with open(path, "rb") as handle:
        assert read_record(handle, 4) == b"abcde"
    path.write_bytes(b"pad." + frame(b"abcde")[:-4])
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^file ends 1 bytes short of the part at offset 4$"):
        read_record(handle, 4)


def test_frame_refusals_and_header_end_are_named_whole(tmp_path):
    path = tmp_path / "r.rec"
    path.write_bytes(frame(b"abcd") + M + b"\0\0")
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^file ends inside the frame header at offset 12$") as error:
        read_record(handle, 12)
    assert error.value.truncated
    path.write_bytes(frame(b"abcd") + b"JUNKJUNK")
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^bad magic 0x4b4e554a at offset 12$") as error:
        read_record(handle, 12)
    assert not error.value.truncated
    path.write_bytes(frame(b"abcd") + M + lrec(3, 0))
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^continuation flag 3 out of sequence at offset 12$"):
        read_record(handle, 12)
    path.write_bytes(M + lrec(1, 0) + M + lrec(1, 0))
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^continuation flag 1 out of sequence at offset 8$"):
        read_record(handle, 0)
    path.write_bytes(M + lrec(4, 0))
    with open(path, "rb") as handle, pytest.raises(RecordIOError, match=r"^continuation flag 4 out of sequence at offset 0$"):
        read_record(handle, 0)


def test_read_index_skips_blank_lines_and_counts_them_in_line_numbers(tmp_path):
    path = tmp_path / "r.idx"
    path.write_text("0\t0\n\n  \n1\t16\n")
    assert read_index(path).tolist() == [[0, 0], [1, 16]]
    assert read_index(path).dtype == np.int64
    path.write_text("")
    assert read_index(path).shape == (0, 2) and read_index(path).dtype == np.int64
    path.write_text("0\t0\n\n1\t16\n2 x\n")
    with pytest.raises(RecordIOError, match=r"^.*r\.idx line 4 is not 'key<TAB>offset' \(two whole numbers below 2\^63\): '2 x'$"):
        read_index(path)
    path.write_text("0\t" + "9" * 70 + "\n")  # the line is shown up to 60 characters
    with pytest.raises(RecordIOError, match=rf"^.*r\.idx line 1 is not 'key<TAB>offset' \(two whole numbers below 2\^63\): '0\\t{'9' * 58}'$"):
        read_index(path)
    path.write_text(f"0\t{2**63 - 1}\n")
    assert read_index(path).tolist() == [[0, 2**63 - 1]]
    path.write_text(f"0\t{2**63}\n")
    with pytest.raises(RecordIOError, match="line 1 is not"):
        read_index(path)


@pytest.mark.parametrize("text, values", [("1,1,1", (1, 1, 1)), ("2147483647,112,96", (2147483647, 112, 96))])
def test_property_txt_bounds_are_inclusive(tmp_path, text, values):
    (tmp_path / "property.txt").write_text(text)
    assert read_property(tmp_path / "property.txt") == values


@pytest.mark.parametrize("text", ["2147483648,112,112", "3,-112,112", "3,112,0"])
def test_property_txt_past_its_bounds_is_refused(tmp_path, text):
    (tmp_path / "property.txt").write_text(text)
    with pytest.raises(RecordIOError, match=rf"^.*property\.txt is not 'num_classes,height,width' \(three whole numbers in 1\.\.2\^31-1\): '{text}'$"):
        read_property(tmp_path / "property.txt")


def test_irheader_ids_round_trip_with_either_label_kind():
    assert unpack(pack(IRHeader(0, 7.0, 12, 5), b"x")) == (IRHeader(0, 7.0, 12, 5), b"x")
    assert unpack(pack(IRHeader(2, (1.0, 2.0), 2**64 - 1, 3), b"")) == (IRHeader(2, (1.0, 2.0), 2**64 - 1, 3), b"")


def test_an_index_line_that_is_not_ascii_is_named_not_a_traceback(tmp_path):
    path = tmp_path / "r.idx"
    path.write_bytes("0\t0\n1\t1é\n".encode())  # UTF-8 é: two bytes that are not ASCII, each shown as U+FFFD
    with pytest.raises(RecordIOError, match=r"^.*r\.idx line 2 is not 'key<TAB>offset' \(two whole numbers below 2\^63\): '1\\t1\ufffd\ufffd'$"):
        read_index(path)
    path.write_bytes(b"0\t0\n1\t\xff\n")  # not UTF-8 either
    with pytest.raises(RecordIOError, match=r"line 2 is not"):
        read_index(path)


def test_property_txt_that_is_not_ascii_or_too_long_is_named(tmp_path):
    path = tmp_path / "property.txt"
    path.write_bytes("3,112,11é\n".encode())
    with pytest.raises(RecordIOError, match=r"^.*property\.txt is not 'num_classes,height,width' \(three whole numbers in 1\.\.2\^31-1\): '3,112,11\ufffd\ufffd'$"):
        read_property(path)
    path.write_bytes(b"3,112,\xff\n")
    with pytest.raises(RecordIOError, match=r"property\.txt is not"):
        read_property(path)
    path.write_text("3,112," + "1" * 70)  # shown up to 60 characters
    with pytest.raises(RecordIOError, match=rf"^.*property\.txt is not .*: '3,112,{'1' * 54}'$"):
        read_property(path)


def test_a_magic_word_in_the_last_aligned_position_is_split_off():
    assert frame(b"AAAA" + M) == M + lrec(1, 4) + b"AAAA" + M + lrec(3, 0)
    assert frame(M) == M + lrec(1, 0) + M + lrec(3, 0)


def test_frame_refuses_a_record_of_2_to_the_29_bytes_by_its_length():
    class Huge(bytes):  # len() of a 512 MiB record without its bytes: refused before any is looked at
        def __len__(self) -> int:
            return 1 << 29

    with pytest.raises(ValueError, match=r"^a RecordIO record holds under 2\^29 bytes, got 536870912$"):
        frame(Huge())
