// torch binding of the planted kernels in faulty.cu: tiered_plants::oob_double and tiered_plants::spin_double.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

void launch_oob_double(float* out, const float* x, int64_t n, cudaStream_t stream);
void launch_spin_double(float* out, const float* x, int64_t n, const int* flag, cudaStream_t stream);

static at::Tensor checked(const at::Tensor& x) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "plants: x must be a float32 CUDA tensor");
    return x.contiguous();
}

at::Tensor oob_double(const at::Tensor& x) {
    auto xc = checked(x);
    auto out = at::empty_like(xc);
    launch_oob_double(out.data_ptr<float>(), xc.data_ptr<float>(), xc.numel(), at::cuda::getCurrentCUDAStream());
    return out;
}

at::Tensor spin_double(const at::Tensor& x) {
    auto xc = checked(x);
    auto out = at::empty_like(xc);
    auto flag = at::zeros({1}, xc.options().dtype(at::kInt));
    launch_spin_double(out.data_ptr<float>(), xc.data_ptr<float>(), xc.numel(), flag.data_ptr<int>(),
                       at::cuda::getCurrentCUDAStream());
    return out;
}

TORCH_LIBRARY(tiered_plants, m) {
    m.def("oob_double(Tensor x) -> Tensor");
    m.def("spin_double(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tiered_plants, CUDA, m) {
    m.impl("oob_double", &oob_double);
    m.impl("spin_double", &spin_double);
}
