//! Finds MLX (docs/ARCHITECTURE.md, D1), compiles our C++ shim against it (D2) and links OpenBLAS ahead of the
//! reference BLAS bundled with the wheel when the system has it (D6; docs/BUILD.md).
//!
//! Search order for MLX: `MLX_DIR`, then an importable `mlx` Python package of the pinned version,
//! then the pinned `mlx-cpu` wheel, downloaded once with pip into a cache folder outside the
//! repository, checked against the sha256 in `vendor/mlx.pin`, and unpacked there.
//!
//! Published to dependents through `links = "mlx"`: `DEP_MLX_RPATH` (the folder holding libmlx,
//! which every final artifact must carry as an rpath: link args do not travel to dependents),
//! `DEP_MLX_INCLUDE`, `DEP_MLX_PREFIX` and `DEP_MLX_OPENBLAS`.

use sha2::{Digest, Sha256};
use std::env;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Pin {
    package: String,
    version: String,
    /// (wheel file name, sha256 hex)
    wheels: Vec<(String, String)>,
}

fn main() {
    if let Err(msg) = run() {
        // One clear line, then stop: cargo shows stderr of a failed build script.
        eprintln!("error: mlx-sys: {msg}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let pin_path = manifest.join("../../vendor/mlx.pin");
    println!("cargo:rerun-if-changed={}", pin_path.display());
    for f in [
        "src/shim.h",
        "src/shim.cc",
        "src/lib.rs",
        "src/qmm_cpu.h",
        "src/qmm_cpu.cc",
        "src/fpq_cpu.h",
        "src/fpq_cpu.cc",
        "src/cpu_common.h",
        "src/fused_cpu.h",
        "src/fused_cpu.cc",
        "src/qpanel_cpu.h",
        "src/qpanel_cpu.cc",
        "src/weight_arena.cc",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    let blas_pin_path = manifest.join("../../vendor/openblas.pin");
    println!("cargo:rerun-if-changed={}", blas_pin_path.display());
    println!("cargo:rerun-if-changed=src/blas_forward.c");
    for v in [
        "MLX_DIR",
        "MLX_RUNNER_CACHE",
        "XDG_CACHE_HOME",
        "MLX_RUNNER_NO_OPENBLAS",
        "MLX_RUNNER_OPENBLAS",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let pin = read_pin(&pin_path)?;
    let prefix = locate_mlx(&pin)?;
    let include = prefix.join("include");
    let lib = prefix.join("lib");

    let blas = choose_blas(&manifest.join("src/blas_forward.c"), &blas_pin_path)?;

    let mut build = cxx_build::bridge("src/lib.rs");
    build
        .file("src/shim.cc")
        .file("src/qmm_cpu.cc")
        .file("src/fpq_cpu.cc")
        .file("src/fused_cpu.cc")
        .file("src/qpanel_cpu.cc")
        .file("src/weight_arena.cc")
        .include(&include)
        .include(&manifest)
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(2);
    match &blas {
        Blas::System(_) => {
            build.define("MLXR_OPENBLAS", None);
        }
        Blas::Wheel(_) => {
            build.define("MLXR_OPENBLAS_WHEEL", None);
        }
        Blas::Reference => {}
    }
    build.compile("mlxr_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    match &blas {
        Blas::System(dir) => {
            // Only the runtime package (libopenblas0-pthread) may be installed, which ships no
            // unversioned .so, hence the verbatim file name. A static initializer in the shim
            // calls openblas_get_config, so --as-needed keeps the library in every binary that
            // links the shim, among its direct NEEDED entries, ahead of the reference BLAS one
            // level down.
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-lib=dylib:+verbatim=libopenblas.so.0");
        }
        Blas::Wheel(dir) => {
            // The forwarder, kept the same way (the shim's initializer calls mlxr_blas_config);
            // it finds libscipy_openblas.so next to itself.
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-lib=dylib:+verbatim={FORWARDER}");
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        }
        Blas::Reference => {}
    }
    // dladdr/dlsym for `blas_library()`.
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());

    // Dependents put this on their binaries' rpath (a list: the forwarder's folder too).
    let rpath = match &blas {
        Blas::Wheel(dir) => format!("{}:{}", lib.display(), dir.display()),
        _ => lib.display().to_string(),
    };
    println!("cargo:rpath={rpath}");
    println!("cargo:include={}", include.display());
    println!("cargo:prefix={}", prefix.display());
    println!(
        "cargo:openblas={}",
        u8::from(!matches!(blas, Blas::Reference))
    );
    Ok(())
}

/// Who serves MLX's `cblas_sgemm` (docs/ARCHITECTURE.md, D6).
enum Blas {
    /// The system's `libopenblas.so.0`, in this folder.
    System(PathBuf),
    /// The pinned scipy-openblas wheel, through [`FORWARDER`] in this folder.
    Wheel(PathBuf),
    /// The reference BLAS bundled with MLX (12-16x slower at float32 matmuls).
    Reference,
}

const FORWARDER: &str = "libmlxr_blas.so";

/// `MLX_RUNNER_OPENBLAS=system|wheel|none` chooses; by default the system's OpenBLAS when there
/// is one, else the pinned wheel's (fetched like MLX, without root), else the reference BLAS
/// with a warning (`MLX_RUNNER_NO_OPENBLAS=1` is `none`).
fn choose_blas(forwarder_src: &Path, pin_path: &Path) -> Result<Blas, String> {
    let choice = env::var("MLX_RUNNER_OPENBLAS").unwrap_or_default();
    let choice = if env::var_os("MLX_RUNNER_NO_OPENBLAS").is_some() {
        "none"
    } else {
        choice.as_str()
    };
    let wheel = || -> Result<Blas, String> {
        let pin = read_pin(pin_path)?;
        let prefix = pinned_wheel(&pin, "vendor/openblas.pin", "scipy_openblas32", |p| {
            p.join("lib/libscipy_openblas.so").is_file()
        })?;
        let lib = prefix.join("lib");
        build_forwarder(forwarder_src, &lib)?;
        Ok(Blas::Wheel(lib))
    };
    match choice {
        "none" => Ok(Blas::Reference),
        "system" => find_openblas()
            .map(Blas::System)
            .ok_or_else(|| "MLX_RUNNER_OPENBLAS=system, but no libopenblas.so.0 was found".into()),
        "wheel" => wheel(),
        "" => match find_openblas() {
            Some(dir) => Ok(Blas::System(dir)),
            None => wheel().or_else(|e| {
                println!(
                    "cargo:warning=no OpenBLAS: float32 matmuls will use the reference BLAS (12-16x slower): {e}"
                );
                Ok(Blas::Reference)
            }),
        },
        other => Err(format!(
            "MLX_RUNNER_OPENBLAS must be system, wheel or none, got {other:?}"
        )),
    }
}

/// Builds [`FORWARDER`] into `lib` (next to libscipy_openblas.so) unless an up-to-date one is
/// there; written to a temporary name and renamed, so a half-written library is never used.
fn build_forwarder(src: &Path, lib: &Path) -> Result<(), String> {
    let out = lib.join(FORWARDER);
    let stamp = lib.join(format!("{FORWARDER}.sha256"));
    let want = sha256_file(src)?;
    if out.is_file() && fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(());
    }
    let tmp = lib.join(format!("{FORWARDER}.tmp-{}", std::process::id()));
    let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&tmp)
        .arg(src)
        .arg(format!("-L{}", lib.display()))
        .arg("-lscipy_openblas")
        .arg("-Wl,-rpath,$ORIGIN")
        .status()
        .map_err(|e| format!("cannot run the C compiler {cc}: {e}"))?;
    if !status.success() {
        return Err(format!("{cc} could not build {FORWARDER}"));
    }
    fs::rename(&tmp, &out).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    fs::write(&stamp, want).map_err(|e| format!("cannot write {}: {e}", stamp.display()))
}

fn read_pin(path: &Path) -> Result<Pin, String> {
    let text =
        fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut pin = Pin {
        package: String::new(),
        version: String::new(),
        wheels: Vec::new(),
    };
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("{}: line without '=': {line}", path.display()))?;
        let (key, value) = (key.trim(), value.trim().to_string());
        match key.split_once(' ') {
            Some(("sha256", wheel)) => pin.wheels.push((wheel.trim().to_string(), value)),
            _ if key == "package" => pin.package = value,
            _ if key == "version" => pin.version = value,
            _ => return Err(format!("{}: unknown key {key}", path.display())),
        }
    }
    if pin.package.is_empty() || pin.version.is_empty() || pin.wheels.is_empty() {
        return Err(format!(
            "{}: needs package, version and at least one sha256 line",
            path.display()
        ));
    }
    Ok(pin)
}

fn is_mlx_prefix(p: &Path) -> bool {
    p.join("include/mlx/mlx.h").is_file()
        && (p.join("lib/libmlx.so").is_file() || p.join("lib/libmlx.dylib").is_file())
}

fn locate_mlx(pin: &Pin) -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("MLX_DIR") {
        let dir = PathBuf::from(dir);
        if is_mlx_prefix(&dir) {
            return Ok(dir);
        }
        return Err(format!(
            "MLX_DIR={} is not an MLX prefix: expected include/mlx/mlx.h and lib/libmlx.so in it",
            dir.display()
        ));
    }
    match python_mlx() {
        Some((version, dir)) if version == pin.version && is_mlx_prefix(&dir) => return Ok(dir),
        Some((version, dir)) if version == pin.version => println!(
            "cargo:warning=python's mlx {version} at {} has no C++ headers or libmlx; using the pinned wheel",
            dir.display()
        ),
        Some((version, _)) => println!(
            "cargo:warning=ignoring python's mlx {version}: mlx-runner is pinned to {} (MLX's C++ API moves between releases)",
            pin.version
        ),
        None => {}
    }
    pinned_wheel(pin, "vendor/mlx.pin", "mlx", is_mlx_prefix)
}

/// The version and package folder of an `mlx` that `python3` can import, if any.
fn python_mlx() -> Option<(String, PathBuf)> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import os, mlx.core as m; print(m.__version__); print(os.path.dirname(m.__file__))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    let version = lines.next()?.trim().to_string();
    let dir = PathBuf::from(lines.next()?.trim());
    Some((version, dir))
}

fn cache_root() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("MLX_RUNNER_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("mlx-runner"));
    }
    if let Some(home) = env::var_os("HOME") {
        return Ok(PathBuf::from(home).join(".cache/mlx-runner"));
    }
    Err("no cache folder for the MLX wheel: set MLX_RUNNER_CACHE (or HOME)".into())
}

fn sha256_file(path: &Path) -> Result<String, String> {
    let mut f = fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The folder `subdir` of a pinned wheel, unpacked (downloading and unpacking it on first use);
/// `complete` says whether the folder holds what it should.
fn pinned_wheel(
    pin: &Pin,
    pin_file: &str,
    subdir: &str,
    complete: fn(&Path) -> bool,
) -> Result<PathBuf, String> {
    let root = cache_root()?;
    let unpacked = root.join(format!("{}-{}", pin.package, pin.version));
    let prefix = unpacked.join(subdir);
    if unpacked.join(".complete").is_file() && complete(&prefix) {
        return Ok(prefix);
    }
    let wheels = root.join("wheels");
    fs::create_dir_all(&wheels).map_err(|e| format!("cannot create {}: {e}", wheels.display()))?;

    let find_verified = || -> Result<Option<PathBuf>, String> {
        for (name, sha) in &pin.wheels {
            let p = wheels.join(name);
            if p.is_file() {
                let got = sha256_file(&p)?;
                if &got == sha {
                    return Ok(Some(p));
                }
                return Err(format!(
                    "{} has sha256 {got}, but {pin_file} expects {sha}; delete it to download again",
                    p.display()
                ));
            }
        }
        Ok(None)
    };

    let wheel = match find_verified()? {
        Some(p) => p,
        None => {
            download_wheel(pin, &wheels)?;
            find_verified()?.ok_or_else(|| {
                format!(
                    "pip downloaded no wheel listed in {pin_file} into {} (this platform may need another build)",
                    wheels.display()
                )
            })?
        }
    };
    unpack(&wheel, &unpacked)?;
    if !complete(&prefix) {
        return Err(format!(
            "{} does not hold what {pin_file} says it should",
            wheel.display()
        ));
    }
    Ok(prefix)
}

fn download_wheel(pin: &Pin, dest: &Path) -> Result<(), String> {
    let spec = format!("{}=={}", pin.package, pin.version);
    let help = format!(
        "MLX is needed to build mlx-runner. Either set MLX_DIR to an MLX prefix (include/mlx, lib/libmlx.so), \
         or install python3 with pip (Debian: `apt-get install python3 python3-pip`) so the build can run \
         `python3 -m pip download --no-deps --only-binary=:all: {spec}`"
    );
    let out = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .arg(&spec)
        .arg("-d")
        .arg(dest)
        .output()
        .map_err(|e| format!("cannot run python3 ({e}). {help}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!(
            "`python3 -m pip download {spec}` failed: {last}. {help}"
        ));
    }
    Ok(())
}

/// Unpacks the wheel into `dest` atomically: a half-written folder is never taken for a good one.
fn unpack(wheel: &Path, dest: &Path) -> Result<(), String> {
    let tmp = dest.with_extension(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let file =
        fs::File::open(wheel).map_err(|e| format!("cannot open {}: {e}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| format!("{} is not a wheel: {e}", wheel.display()))?;
    zip.extract(&tmp)
        .map_err(|e| format!("cannot unpack {}: {e}", wheel.display()))?;
    fs::write(tmp.join(".complete"), b"")
        .map_err(|e| format!("cannot write into {}: {e}", tmp.display()))?;
    let _ = fs::remove_dir_all(dest);
    fs::rename(&tmp, dest)
        .map_err(|e| format!("cannot move {} to {}: {e}", tmp.display(), dest.display()))
}

/// The folder holding `libopenblas.so.0`, if the system has one.
fn find_openblas() -> Option<PathBuf> {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/opt/homebrew/opt/openblas/lib",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("libopenblas.so.0").exists())
}
