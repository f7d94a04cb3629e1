"""The extension's argument checks build their messages without a std::ostream (csrc/check_message.h).

On the GPU image (2026-12-04) every C++ check whose message held a number crashed the process with
a segmentation fault, inside the num_put facet: that image's g++ links a second libstdc++ into the
extension, whose stream formatting of numbers does not work against the process's locale. The same
happens here, without a GPU, when a small extension is linked with -static-libstdc++ (gcc 12 drops
the number and the rest of the message instead of crashing). G4_CHECK must give the whole message in
such a build; a plain TORCH_CHECK, built the same way, shows that the build reproduces the hazard.
"""
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

EXTENSION = r"""
#include <torch/extension.h>
#include "check_message.h"

void ours(const at::Tensor& t) {
  G4_CHECK(t.dim() == 7, "gemma4_mtp: t must have ", 7, " dimensions, got shape ", t.sizes(), " (dtype ",
           t.scalar_type(), ", on ", t.device(), ", element size ", t.element_size(), ", offset ",
           t.storage_offset(), ", scale ", 0.5, ")");
}
void plain(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 7, "torch: t must have ", 7, " dimensions, got shape ", t.sizes(), " (end)");
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ours", &ours);
  m.def("plain", &plain);
}
"""

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch.utils.cpp_extension import load
    m = load(name="g4_check_message", sources=[sys.argv[1]], extra_include_paths=[sys.argv[2]],
             extra_cflags=["-std=c++20"], extra_ldflags=["-static-libstdc++"], build_directory=sys.argv[3])
    t = torch.zeros(2, 3)[:, 1:]
    for fn in (m.ours, m.plain):  # ours first: a crash in plain cannot hide its line
        try:
            fn(t)
            print("no error", flush=True)
        except (RuntimeError, ValueError) as e:
            print(type(e).__name__ + ": " + str(e).splitlines()[0], flush=True)
""")


def test_messages_keep_their_numbers_where_a_second_libstdcxx_breaks_streams(tmp_path):
    assert "TORCH_CHECK(" not in (ROOT / "csrc" / "torch_bindings.cpp").read_text(), \
        "torch_bindings.cpp checks through G4_CHECK (csrc/check_message.h), never TORCH_CHECK"
    src = tmp_path / "ext.cpp"
    src.write_text(EXTENSION)
    build = tmp_path / "build"
    build.mkdir()
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(ROOT / "csrc"), str(build)],
                         capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    # an argument check raises what the Python ops raise for it (a ValueError)
    assert lines and lines[0] == ("ValueError: gemma4_mtp: t must have 7 dimensions, got shape [2, 2] (dtype Float, "
                                  "on cpu, element size 4, offset 1, scale 0.500000)"), run.stdout + run.stderr[-3000:]
    # the control: a plain TORCH_CHECK built the same way loses its numbers (or the process dies)
    intact = "RuntimeError: torch: t must have 7 dimensions, got shape [2, 2] (end)"
    assert run.returncode != 0 or lines[1:] != [intact], \
        "this -static-libstdc++ build formats numbers correctly: it no longer reproduces the hazard"
