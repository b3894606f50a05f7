// The chunked gated delta rule of gated_delta.cu with one tensor-core pass per product (hi x hi): the fast
// precision's kernels, same entries, same workspace layout (the lo halves are written and not read).
//
// numpy twin: clefcore/backends/cpu.py::gated_delta_rule (as gated_delta.cu)
#define GDN_PASSES 1
#include "gated_delta.cu"
