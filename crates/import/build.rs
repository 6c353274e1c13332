// Link arguments never reach dependents, so each crate whose tests or binaries load libmlx
// carries the rpath that mlx-sys publishes (docs/BUILD.md §3, "rpath does not travel").
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
