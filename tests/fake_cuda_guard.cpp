// A no-op CUDA device guard for torch's CPU-only build, so that fake CUDA tensors
// (torch._subclasses.fake_tensor.FakeTensorMode) can be indexed, copied into and recorded by
// autograd's forward. torch registers one itself only on a CUDA build without a device.
// Used by tests/test_fake_cuda.py, in a subprocess of its own.
#include <Python.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;

void register_guard() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  if (slot.load() == nullptr) {
    slot.store(&fake_cuda_guard);
  }
}
}  // namespace

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "fake_cuda_guard", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit_fake_cuda_guard(void) {
  register_guard();
  return PyModule_Create(&module_def);
}
