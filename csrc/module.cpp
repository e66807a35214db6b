// rlperf._C: the Python module and the schemas of the torch.ops.rlperf operators.
//
// The module itself is empty: importing it loads this library, whose static initializers register
// the operators with PyTorch's dispatcher (TORCH_LIBRARY below; the CPU and CUDA kernels register
// in flatten.cpp and flatten_cuda.cu). Python calls them as torch.ops.rlperf.<name>. No pybind11
// and no libtorch_python: the same sources build under setup.py and under plain CMake.
#include <Python.h>

#include <torch/library.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "rlperf C++/CUDA operators, registered as torch.ops.rlperf.* when this module is imported.",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(rlperf, m) {
  // Contracts in flatten.h. chunk_bytes = 0 picks the device's default chunk size.
  m.def("multi_tensor_pack(Tensor[] srcs, Tensor(a!) bucket, int[] offsets, int chunk_bytes=0) -> ()");
  m.def("multi_tensor_unpack(Tensor bucket, Tensor(a!)[] dsts, int[] offsets, int chunk_bytes=0) -> ()");
  m.def("bucket_checksum(Tensor bucket) -> int");
}
