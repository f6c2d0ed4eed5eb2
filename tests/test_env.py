import pytest
import torch

from kvlab import env


def test_report_describes_this_machine(capsys):
    info = env.report()
    assert info["torch"] == torch.__version__
    assert info["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert info["colab"] is False
    if not torch.cuda.is_available():
        assert info["gpu"] is None and info["compute_dtype"] == "float32"
    env.print_report()
    assert "torch" in capsys.readouterr().out


def test_colab_is_detected_from_its_environment(monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-test")
    assert env.on_colab()


def test_cpu_computes_in_float32():
    assert env.half_dtype(torch.device("cpu")) == torch.float32


def test_bf16_counts_only_where_the_gpu_does_it_natively(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))  # T4
    assert not env.fast_bf16(cuda) and env.half_dtype(cuda) == torch.float16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))  # A100
    assert env.fast_bf16(cuda) and env.half_dtype(cuda) == torch.bfloat16
    assert not env.fast_bf16(torch.device("cpu"))


def test_cpp_compiler_is_found_on_the_path_or_in_cxx(monkeypatch, tmp_path):
    fake = tmp_path / "my-c++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert env.cpp_compiler() is None          # my-c++ is none of the usual names
    monkeypatch.setenv("CXX", "my-c++")
    assert env.cpp_compiler() == str(fake)
    assert env.report()["cpp_compiler"] == "my-c++"   # the name: no machine's paths in notebooks


def test_setup_sets_the_cpu_threads_once_for_a_chapter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(env.THREADS_VARIABLE, raising=False)
    before = torch.get_num_threads()
    try:
        assert env.setup() == torch.device("cpu") and torch.get_num_threads() == env.DEFAULT_CPU_THREADS
        env.setup(threads=2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv(env.THREADS_VARIABLE, "3")   # a learner's machine-wide choice
        env.setup()
        assert torch.get_num_threads() == 3
        env.setup(threads=1)                            # an explicit argument wins
        assert torch.get_num_threads() == 1
        monkeypatch.setenv(env.THREADS_VARIABLE, "many")
        with pytest.raises(ValueError, match="KVLAB_THREADS='many' must be a whole number"):
            env.setup()
        with pytest.raises(ValueError, match="threads=0 must be an integer >= 1"):
            env.setup(threads=0)
    finally:
        torch.set_num_threads(before)


def test_setup_leaves_a_gpu_machine_s_threads_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(env.THREADS_VARIABLE, raising=False)
    before = torch.get_num_threads()
    assert env.setup() == torch.device("cuda") and torch.get_num_threads() == before
