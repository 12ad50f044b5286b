"""Files written whole: the old file or the new one, never half of one, and no temporary left behind."""

import pytest

from spill.errors import SpillError
from spill.files import new_folder, replaced, temporary_for


def test_a_file_is_replaced_once_written(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with replaced(path) as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old"   # not yet: readers see the old file while it is written
    assert path.read_text() == "new" and not temporary_for(path).exists()


def test_an_error_while_writing_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with pytest.raises(OSError):
        with replaced(path) as tmp:
            tmp.write_text("half")
            raise OSError("disk full")
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]


def test_a_new_folder_appears_whole_or_not_at_all(tmp_path):
    with new_folder(tmp_path / "m") as tmp:
        (tmp / "config.json").write_text("{}")
        assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and (tmp_path / "m" / "config.json").exists()
    with pytest.raises(ValueError), new_folder(tmp_path / "n") as tmp:
        (tmp / "half").write_text("x")
        raise ValueError("stopped")
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    with pytest.raises(SpillError, match="exists and is not empty; choose a new folder or empty it first$"):
        with new_folder(tmp_path / "m"):
            pass
