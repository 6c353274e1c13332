/* MLX's float32 matmuls call cblas_sgemm. Where the system has no OpenBLAS, the build fetches
 * the OpenBLAS that SciPy ships for numpy/scipy wheels (vendor/openblas.pin), whose symbols are
 * prefixed; this library, a direct dependency of every binary, puts the unprefixed name in
 * front of the reference BLAS that libmlx's wheel bundles. The enums of the CBLAS interface
 * are passed as ints, and scipy-openblas32 uses 32-bit integers. */

typedef int blasint;

extern void scipy_cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n,
                              blasint k, float alpha, const float *a, blasint lda,
                              const float *b, blasint ldb, float beta, float *c, blasint ldc);
extern char *scipy_openblas_get_config(void);

void cblas_sgemm(int order, int trans_a, int trans_b, blasint m, blasint n, blasint k,
                 float alpha, const float *a, blasint lda, const float *b, blasint ldb,
                 float beta, float *c, blasint ldc) {
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* Which OpenBLAS serves, for `mlx-runner info`; also what keeps this library linked. */
const char *mlxr_blas_config(void) { return scipy_openblas_get_config(); }
