// The WY-form delta rule of gated_delta_wy.cu with every product in one fp16 pass: fast's operands
// (gated_delta_wy_fast.cu) plus the solve's K K^T and the state recurrence (W S, K^T Vd), which fast splits. The
// scan's chain of dependent products per chunk is a third as long, and no lo halves of K or -W are written or
// read. Same entries, same workspace layout. docs/studies/gdn_wy_precision.py ("wy one pass (all fp16)"): the
// state is 3.8e-4..3.9e-4 off at 2,048 tokens of 128 x 128 heads (fast's: fp32-grade), the output 3.3e-4..5.0e-4
// (fast's 3.3e-4..4.2e-4), fast's emulated golden error 5.1e-3 median, 7.4e-3 worst of 12 runs (fast's 6.1e-3,
// 9.0e-3). A prefill reads the state only through the outputs of the chunks after it, which those figures hold.
//
// numpy twin: clefcore/backends/cpu.py::gated_delta_rule (as gated_delta_wy.cu); error model: tests/gdn_wy_model.py
#define WY_KK_PASSES 1
#define WY_SCAN_PASSES 1
#define WY_QS_PASSES 1
#define WY_QK_PASSES 1
#define WY_PV_PASSES 1
#include "gated_delta_wy.cu"
