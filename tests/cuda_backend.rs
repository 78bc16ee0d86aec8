//! `--backend cuda` and `auto` without a GPU: a clear error or a fallback with the reason, never
//! a panic. In the default build `cuda` names the feature to build with; in a `--features cuda`
//! build on a machine without the driver (or a device, or NVRTC) it names what is missing, and
//! `auto` falls back. On a machine with a device the backend opens and reports its memory.

use tern::backend::pick::{pick, CUDA_BUILT};

#[test]
fn cuda_is_a_clear_error_or_a_device() {
    match pick("cuda") {
        Ok(p) => {
            if !CUDA_BUILT {
                panic!("only a cuda build can open the cuda backend");
            }
            assert_eq!(p.name(), "cuda");
        }
        Err(e) => {
            let msg = e.to_string();
            println!("--backend cuda: {msg}");
            assert!(msg.contains("cuda"), "{msg}");
            if !CUDA_BUILT {
                assert!(msg.contains("--features cuda"), "{msg}");
            }
        }
    }
}

#[test]
fn auto_always_picks_something() {
    let p = pick("auto").expect("auto never fails");
    println!("auto picked {}", p.name());
}

#[test]
fn device_memory_only_from_cuda() {
    assert!(tern::backend::pick::device_memory("wgpu").is_none());
    assert!(tern::backend::pick::device_memory("cpu").is_none());
    assert_eq!(
        tern::backend::pick::device_memory("cuda").is_some(),
        CUDA_BUILT
    );
}

#[cfg(feature = "cuda")]
#[test]
fn device_memory_or_the_reason() {
    match tern::backend::cuda::device_memory() {
        Ok((free, total)) => {
            println!(
                "cuda device memory: {} MiB free of {} MiB",
                free >> 20,
                total >> 20
            );
            assert!(free <= total && total > 0);
        }
        Err(e) => {
            println!("no cuda device memory to report: {e}");
            assert!(tern::backend::cuda::CudaBackend::new().is_err());
        }
    }
}
