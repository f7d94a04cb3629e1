// Stands in for the CUDA header of this name when a host-side launcher source (csrc/ops/*.cu) is
// compiled for the emulation: the types and runtime calls it uses come from emu.h.
#pragma once

#include "emu.h"
