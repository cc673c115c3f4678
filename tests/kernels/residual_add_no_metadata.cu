// residual_add exported without signature metadata, even though `trtmc kernel build` asks for it:
// stands for DSOs that carry none (CuTe DSL exports), which binding must accept as "unknown".
#undef TVM_FFI_DLL_EXPORT_INCLUDE_METADATA
#include "../../examples/byok/residual_add.cu"
