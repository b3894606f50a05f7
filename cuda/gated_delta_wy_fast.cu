// The WY-form delta rule of gated_delta_wy.cu with the fast precision's operands: the solve's K K^T and the state
// recurrence (W S, K^T Vd) in three passes, whose roundings would accumulate over the chunks; the output's three
// products (Q S_in, Q K^T, (Q K^T * D) V') in one, whose roundings reach each output once. Same entries, same
// workspace layout. docs/studies/gdn_wy_precision.py: the state stays fp32-grade (3.5e-7..8e-7 at 2,048 tokens of
// 128 x 128 heads), the output is 3.3e-4..4.2e-4 off (one rounding), and fast's golden error does not grow.
//
// numpy twin: clefcore/backends/cpu.py::gated_delta_rule (as gated_delta_wy.cu); error model: tests/gdn_wy_model.py
#define WY_QS_PASSES 1
#define WY_QK_PASSES 1
#define WY_PV_PASSES 1
#include "gated_delta_wy.cu"
