"""_te_import.share_torch_cudnn (the te engine's import helper): TransformerEngine is pointed at
torch's cuDNN, never over the user's choice.

The effect itself (one cuDNN in the process, cuDNN attention kept) needs a GPU and TE; it is
checked in tests/gpu/test_te.py. Here: when the variable is set, and when it is left alone."""

import ctypes
import os

import pytest

from fp8plug.backends.te import imports as te_backend


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    monkeypatch.delenv("CUDNN_HOME", raising=False)
    monkeypatch.setattr(te_backend.torch.cuda, "is_available", lambda: True)
    return monkeypatch


def test_points_te_at_torchs_cudnn(clean_env, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libcudnn_ops.so.9", "libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_cnn.so.9"):
        (lib / name).write_bytes(b"")
    loaded = []
    clean_env.setattr(ctypes, "CDLL", lambda path, mode=0: loaded.append(os.path.basename(path)))
    clean_env.setattr(te_backend, "torch_cudnn_dir", lambda: str(tmp_path))
    assert te_backend.share_torch_cudnn() == str(tmp_path)
    assert os.environ["CUDNN_PATH"] == str(tmp_path)
    # every library of torch's cuDNN is loaded, the dispatcher and graph library first
    assert loaded == ["libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_cnn.so.9", "libcudnn_ops.so.9"]


def test_a_cudnn_that_does_not_load_changes_nothing(clean_env, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libcudnn.so.9").write_bytes(b"not a library")
    clean_env.setattr(te_backend, "torch_cudnn_dir", lambda: str(tmp_path))
    assert te_backend.share_torch_cudnn() is None and "CUDNN_PATH" not in os.environ


@pytest.mark.parametrize("variable", ["CUDNN_PATH", "CUDNN_HOME"])
def test_a_users_cudnn_choice_is_kept(clean_env, variable):
    clean_env.setenv(variable, "/opt/my-cudnn")
    clean_env.setattr(te_backend, "torch_cudnn_dir", lambda: "/elsewhere")
    assert te_backend.share_torch_cudnn() is None
    assert os.environ[variable] == "/opt/my-cudnn"
    assert os.environ.get("CUDNN_PATH") in (None, "/opt/my-cudnn")


def test_nothing_changes_without_torchs_cudnn_or_a_gpu(clean_env):
    clean_env.setattr(te_backend, "torch_cudnn_dir", lambda: None)
    assert te_backend.share_torch_cudnn() is None and "CUDNN_PATH" not in os.environ
    clean_env.setattr(te_backend.torch.cuda, "is_available", lambda: False)
    clean_env.setattr(te_backend, "torch_cudnn_dir", lambda: "/somewhere")
    assert te_backend.share_torch_cudnn() is None and "CUDNN_PATH" not in os.environ


def test_torch_cudnn_dir_finds_the_wheel_folder(monkeypatch, tmp_path):
    folder = tmp_path / "nvidia" / "cudnn"
    (folder / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / "__init__.py").write_text("")
    (folder / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys
    for name in [n for n in sys.modules if n == "nvidia" or n.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert te_backend.torch_cudnn_dir() is None  # the folder is there, the library is not
    (folder / "lib" / "libcudnn.so.9").write_bytes(b"")
    assert te_backend.torch_cudnn_dir() == str(folder)


def test_too_late_once_te_is_imported(clean_env, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, te_backend.TE_MODULE, object())
    clean_env.setattr(te_backend, "torch_cudnn_dir", lambda: "/somewhere")
    assert te_backend.share_torch_cudnn() is None and "CUDNN_PATH" not in os.environ
