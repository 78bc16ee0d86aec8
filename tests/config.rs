//! The YAML config: one schema with the flags, strict keys and values, file-then-flags merge,
//! and the shipped example.

mod scratch;
use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use clap::Parser;
use tern::cli::config::{run_to, ConfigArgs};
use tern::config::flags::Rewritten;
use tern::config::{
    ConfigError, GpuLayers, LoraScaled, Reasoning, ReasoningFormat, Settings, Source, Sources,
};
use tern::plan::{BackendKind, FlashAttn, KvType, SpecType};

fn parse(yaml: &str) -> Result<Settings, ConfigError> {
    Settings::from_yaml(yaml, Path::new("test.yaml"))
}

fn tmp(name: &str) -> PathBuf {
    scratch::dir("config").join(name)
}

fn zealot() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/zealot.yaml")
}

/// The flags as a subcommand would parse them.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    s: Settings,
}

/// The flags as `main` hands them to clap: llama-server's spellings rewritten first.
fn flags(args: &[&str]) -> Settings {
    flags_and_rewrite(args).0
}

fn flags_and_rewrite(args: &[&str]) -> (Settings, Rewritten) {
    let rw = tern::config::flags::rewrite(args).unwrap_or_else(|e| panic!("{e}"));
    let s = Flags::try_parse_from(std::iter::once("tern".to_string()).chain(rw.args.clone()))
        .unwrap_or_else(|e| panic!("{e}"))
        .s;
    (s, rw)
}

#[test]
fn the_shipped_example_is_the_seed_shape() {
    let (s, notes) = Settings::load_with_notes(zealot()).unwrap_or_else(|e| panic!("{e}"));
    // `jinja: true` is accepted and changes nothing (tern always renders with Jinja).
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].to_string().contains("key `jinja`"), "{}", notes[0]);
    assert_eq!(
        s.model.as_deref(),
        Some(Path::new(
            "/home/dank/models/Bonsai2-9B-MTP/Ternary-Bonsai-2-9B-PQ2_0-MTP-Q8_0.gguf"
        ))
    );
    assert_eq!(
        s.mmproj.as_deref(),
        Some(Path::new(
            "/home/dank/models/Bonsai2-9B-MTP/Ternary-Bonsai-2-9B-mmproj-Q8_0.gguf"
        ))
    );
    assert_eq!(s.alias.as_deref(), Some("frank-zealot"));
    assert_eq!(s.host.as_deref(), Some("0.0.0.0"));
    assert_eq!(s.port, Some(7771));
    assert_eq!(s.n_gpu_layers, Some(GpuLayers::N(99)));
    assert_eq!(s.metrics, Some(true));
    assert_eq!(s.reasoning, Some(Reasoning::Auto));
    assert_eq!(s.reasoning_format, Some(ReasoningFormat::Deepseek));
    assert_eq!(s.log_verbosity, Some(4));
    assert_eq!(s.presence_penalty, Some(1.0));
    assert_eq!(s.spec_draft_n_min, Some(0));
    assert_eq!(s.spec_draft_p_min, Some(0.0));
    assert_eq!(s.device_mib, Some(24_123));
    let sh = s.shape();
    assert_eq!(
        (sh.ctx_size, sh.parallel, sh.n_ctx_slot()),
        (602_112, 3, 200_704)
    );
    assert_eq!(
        (sh.cache_type_k, sh.cache_type_v),
        (KvType::F16, KvType::Q8_0)
    );
    assert_eq!(sh.flash_attn, FlashAttn::On);
    assert_eq!((sh.spec, sh.draft_n_max), (SpecType::DraftMtp, 2));
    assert_eq!(
        (sh.spec_draft_type_k, sh.spec_draft_type_v),
        (KvType::F16, KvType::F16)
    );
    assert_eq!((sh.ubatch_size, sh.batch_size), (1024, 6144));
    assert_eq!(sh.backend, BackendKind::Cuda);
    assert_eq!(sh.margin_mib, 1024);
}

#[test]
fn unknown_keys_are_errors_naming_them() {
    let e = parse("ctx-size: 4096\nctx-sise: 8192\n").unwrap_err();
    let m = e.to_string();
    assert!(m.contains("ctx-sise"), "{m}");
    assert!(m.contains("line 2"), "{m}");
    // The invented variable of the old deployment: never swallowed.
    let m = parse("kv-cache-type: q8_0\n").unwrap_err().to_string();
    assert!(m.contains("kv-cache-type"), "{m}");
    // Underscores are not the flag names.
    let m = parse("cache_type_k: f16\n").unwrap_err().to_string();
    assert!(m.contains("cache_type_k"), "{m}");
}

#[test]
fn bad_values_are_errors_naming_the_key() {
    let cases = [
        ("cache-type-v: q9_0\n", "cache-type-v", "q9_0"),
        ("port: -1\n", "port", "port: -1"),
        ("port: 70000\n", "port", "70000"),
        ("ctx-size: lots\n", "ctx-size", "lots"),
        ("flash-attn: maybe\n", "flash-attn", "maybe"),
        ("spec-type: draft-eagle\n", "spec-type", "draft-eagle"),
        ("backend: tpu\n", "backend", "tpu"),
        ("temp: hot\n", "temp", "hot"),
        ("image-max-tokens: many\n", "image-max-tokens", "many"),
        ("image-min-tokens: 1.5\n", "image-min-tokens", "1.5"),
        (
            "lora-scaled: [a.gguf:0.5, b.gguf]\n",
            "lora-scaled[1]",
            "FILE:SCALE",
        ),
        (
            "lora-scaled: [a.gguf:x]\n",
            "lora-scaled[0]",
            "not a number",
        ),
        ("model: [a, b]\n", "model", ""),
    ];
    for (yaml, key, also) in cases {
        let e = parse(yaml).unwrap_err();
        match &e {
            ConfigError::Yaml { key: k, .. } => assert_eq!(k, key, "{yaml:?}: {e}"),
            other => panic!("{yaml:?}: {other}"),
        }
        let m = e.to_string();
        assert!(m.contains(&format!("key `{key}`")), "{yaml:?}: {m}");
        assert!(m.contains(also), "{yaml:?}: {m}");
        assert!(m.contains("test.yaml"), "{m}");
    }
    // Malformed documents and duplicate keys.
    assert!(parse("[1, 2]\n").is_err());
    let m = parse("port: 80\nport: 81\n").unwrap_err().to_string();
    assert!(m.contains("duplicate") && m.contains("port"), "{m}");
    assert!(parse("ctx-size: 4096\n  parallel: 2\n").is_err());
}

#[test]
fn range_checks_name_the_key() {
    for (yaml, key) in [
        ("top-p: 1.5\n", "top-p"),
        ("min-p: -0.1\n", "min-p"),
        ("repeat-penalty: 0\n", "repeat-penalty"),
        ("threads: 100000\n", "threads"),
        ("n-predict: -2\n", "n-predict"),
        ("spec-draft-n-max: 4294967296\n", "spec-draft-n-max"),
        ("chat-template-kwargs: \"[1]\"\n", "chat-template-kwargs"),
        ("seed: -2\n", "seed"),
        ("parallel: 0\n", "parallel"),
        ("ctx-size: 602113\nparallel: 3\n", "ctx-size"),
        (
            "spec-draft-n-min: 3\nspec-draft-n-max: 2\n",
            "spec-draft-n-min",
        ),
        ("image-max-tokens: 1048577\n", "image-max-tokens"),
        (
            "image-min-tokens: 1024\nimage-max-tokens: 256\n",
            "image-max-tokens",
        ),
    ] {
        let path = tmp("range.yaml");
        std::fs::write(&path, yaml).unwrap();
        let e = Settings::load(&path).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
            "{yaml:?}: {e}"
        );
        assert!(e.to_string().starts_with(key), "{e}");
    }
}

#[test]
fn empty_and_comment_only_files_set_nothing() {
    assert_eq!(parse("").unwrap(), Settings::default());
    assert_eq!(parse("# nothing here\n").unwrap(), Settings::default());
}

#[test]
fn missing_file_is_an_error_naming_it() {
    let e = Settings::load("/no/such/tern.yaml").unwrap_err();
    assert!(e.to_string().contains("/no/such/tern.yaml"), "{e}");
}

#[test]
fn flags_have_the_same_names_and_override_the_file() {
    let f = flags(&[
        "--ctx-size",
        "401408",
        "--parallel",
        "2",
        "--cache-type-v",
        "f16",
        "--spec-type",
        "none",
        "--lora-scaled",
        "/x/adapter.gguf:0.5",
        "--jinja",
        "--metrics=false",
        "--n-gpu-layers",
        "-1",
    ]);
    assert_eq!(f.ctx_size, Some(401_408));
    assert_eq!(f.metrics, Some(false));
    assert_eq!(f.n_gpu_layers, Some(GpuLayers::N(-1)));
    assert_eq!(
        f.lora_scaled,
        Some(vec![LoraScaled {
            path: "/x/adapter.gguf".into(),
            scale: 0.5
        }])
    );
    let file = Settings::load(zealot()).unwrap();
    let m = file.clone().merge(f);
    assert_eq!(m.ctx_size, Some(401_408));
    assert_eq!(m.parallel, Some(2));
    assert_eq!(m.cache_type_v, Some(KvType::F16));
    assert_eq!(m.spec_type, Some(SpecType::None));
    assert_eq!(m.metrics, Some(false));
    // Untouched keys keep the file's values.
    assert_eq!(m.cache_type_k, Some(KvType::F16));
    assert_eq!(m.port, Some(7771));
    assert_eq!(m.model, file.model);
    // No flags: the file as it is.
    assert_eq!(file.clone().merge(Settings::default()), file);
    // Bad flag values are clap errors naming the flag.
    let e = Flags::try_parse_from(["tern", "--cache-type-v", "q9_0"])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--cache-type-v") && e.contains("q9_0"), "{e}");
    assert!(Flags::try_parse_from(["tern", "--port", "-1"]).is_err());
    assert!(Flags::try_parse_from(["tern", "--lora-scaled", "adapter.gguf"]).is_err());
}

#[test]
fn relative_paths_in_a_file_are_relative_to_it() {
    let path = tmp("rel.yaml");
    std::fs::write(
        &path,
        "model: m.gguf\nmmproj: /abs/p.gguf\nlora-scaled: [\"a/l.gguf:0\"]\n",
    )
    .unwrap();
    let s = Settings::load(&path).unwrap();
    let dir = path.parent().unwrap();
    assert_eq!(s.model, Some(dir.join("m.gguf")));
    assert_eq!(s.mmproj, Some(PathBuf::from("/abs/p.gguf")));
    assert_eq!(s.lora_scaled.unwrap()[0].path, dir.join("a/l.gguf"));
}

#[test]
fn print_shows_the_merged_settings_as_yaml_that_parses_back() {
    let args = ConfigArgs {
        config: Some(zealot()),
        print: true,
        explain: false,
        settings: flags(&[
            "--parallel",
            "2",
            "--ctx-size",
            "401408",
            "--api-key",
            "s3cret",
        ]),
    };
    let mut out = Vec::new();
    run_to(&args, &mut out).unwrap();
    let y = String::from_utf8(out).unwrap();
    println!("{y}");
    assert!(y.contains("ctx-size: 401408"), "{y}");
    assert!(y.contains("parallel: 2"), "{y}");
    assert!(y.contains("cache-type-v: q8_0"), "{y}");
    assert!(y.contains("spec-draft-n-max: 2"), "{y}");
    assert!(!y.contains("s3cret"), "the API key is redacted: {y}");
    let back = parse(&y).unwrap();
    let mut want = Settings::load(zealot())
        .unwrap()
        .merge(args.settings.clone());
    want.api_key = Some("<redacted>".into());
    assert_eq!(back, want);

    // A bad merged result is refused: the flag breaks the file's divisibility.
    let args = ConfigArgs {
        config: Some(zealot()),
        print: true,
        explain: false,
        settings: flags(&["--parallel", "5"]),
    };
    let e = run_to(&args, &mut Vec::new()).unwrap_err();
    assert!(format!("{e:#}").contains("ctx-size"), "{e:#}");
}

/// The wiring `src/main.rs` gets: the three subcommands hold these Args structs.
#[derive(Parser)]
struct Wired {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    Fit(tern::cli::fit::FitArgs),
    Config(ConfigArgs),
    Verify(tern::cli::verify::VerifyArgs),
}

#[test]
fn the_subcommands_are_well_formed_clap() {
    use clap::CommandFactory;
    Wired::command().debug_assert();
    let w = Wired::try_parse_from([
        "tern",
        "fit",
        "--config",
        "z.yaml",
        "-m",
        "m.gguf",
        "--device-mib",
        "24123",
        "--cache-type-v",
        "q8_0",
        "--json",
    ])
    .unwrap();
    let Cmd::Fit(a) = w.cmd else {
        panic!("not fit")
    };
    assert!(a.json);
    assert_eq!(a.config, Some(PathBuf::from("z.yaml")));
    assert_eq!(a.settings.device_mib, Some(24_123));
    assert_eq!(a.settings.cache_type_v, Some(KvType::Q8_0));
    let w = Wired::try_parse_from([
        "tern",
        "verify",
        "--model",
        "m.gguf",
        "--sha256",
        "ab",
        "--bytes",
        "10",
        "--mmproj",
        "p.gguf",
        "--mmproj-sha256",
        "cd",
        "--manifest",
        "f.json",
    ])
    .unwrap();
    let Cmd::Verify(v) = w.cmd else {
        panic!("not verify")
    };
    assert_eq!(v.bytes, Some(10));
    assert_eq!(v.mmproj_sha256.as_deref(), Some("cd"));
    let w = Wired::try_parse_from(["tern", "config", "--print", "--backend", "cpu"]).unwrap();
    let Cmd::Config(c) = w.cmd else {
        panic!("not config")
    };
    assert!(c.print);
    assert_eq!(c.settings.backend, Some(BackendKind::Cpu));
}

#[test]
fn llama_server_keys_in_a_file_are_read_warned_or_refused() {
    let origin = Path::new("l.yaml");
    let (s, notes) = Settings::from_yaml_with_notes(
        "temperature: 0.5\ngpu-layers: all\nno-slots: true\ncont-batching: true\nlog-jsonl: true\n",
        origin,
    )
    .unwrap();
    assert_eq!(s.temp, Some(0.5), "llama-server's other spelling of temp");
    assert_eq!(s.n_gpu_layers, Some(GpuLayers::All));
    assert_eq!(s.slots, Some(false));
    assert_eq!(s.log_format, Some(tern::config::LogFormat::Json));
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0]
            .to_string()
            .contains("key `cont-batching`: ignored"),
        "{}",
        notes[0]
    );
    for (yaml, key) in [
        ("hf-repo: unsloth/x\n", "hf-repo"),
        ("jinja: false\n", "jinja"),
        ("no-jinja: true\n", "no-jinja"),
    ] {
        let e = Settings::from_yaml_with_notes(yaml, origin)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(key) && e.contains("not supported"),
            "{yaml:?}: {e}"
        );
    }
    // Two names of one key, and a key neither tern nor llama-server knows (with its line).
    let e = Settings::from_yaml("temp: 1\ntemperature: 2\n", origin).unwrap_err();
    assert!(e.to_string().contains("temp"), "{e}");
    let e = Settings::from_yaml("temperature: 1\nctx-sise: 2\n", origin).unwrap_err();
    assert!(e.to_string().contains("ctx-sise"), "{e}");
}

#[test]
fn config_files_over_a_mebibyte_are_refused() {
    let big = tmp("big.yaml");
    let mut text = String::from("ctx-size: 4096\n");
    while text.len() <= 1 << 20 {
        text.push_str("# padding padding padding padding padding padding padding padding\n");
    }
    std::fs::write(&big, text).unwrap();
    let e = Settings::load(&big).unwrap_err();
    assert!(matches!(e, ConfigError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("big.yaml"), "{e}");
    // A device that never ends is cut at the limit, not read forever.
    let t0 = std::time::Instant::now();
    let e = Settings::load("/dev/zero").unwrap_err();
    assert!(matches!(e, ConfigError::TooLarge { .. }), "{e}");
    assert!(t0.elapsed().as_secs() < 5);
    let e = Settings::load(std::env::temp_dir()).unwrap_err();
    assert!(e.to_string().contains("directory"), "{e}");
}

#[test]
fn flag_over_environment_over_file_over_default() {
    let file = tmp("prec.yaml");
    std::fs::write(&file, "ctx-size: 1024\nparallel: 2\ntemp: 0.1\ntop-k: 5\n").unwrap();
    let env: BTreeMap<&str, &str> = BTreeMap::from([
        ("LLAMA_ARG_CTX_SIZE", "2048"),
        ("LLAMA_ARG_TEMPERATURE", "0.2"),
        ("LLAMA_API_KEY", "env-key"),
        ("LLAMA_ARG_NO_ENDPOINT_SLOTS", "1"),
        ("LLAMA_ARG_CONT_BATCHING", "1"),
        ("HF_TOKEN", "hf_x"),
    ]);
    let get = |k: &str| env.get(k).map(|v| v.to_string());
    let (flags, rw) = flags_and_rewrite(&["-c", "4096", "-ngl", "99"]);
    let src = Sources::gather(Some(&file), &get, flags, rw).unwrap();
    let r = src.resolve().unwrap();
    let s = &r.settings;
    assert_eq!(s.ctx_size, Some(4096), "flag over env over file");
    assert_eq!(s.temp, Some(0.2), "env over file");
    assert_eq!(s.top_k, Some(5), "file over default");
    assert_eq!(s.parallel, Some(2));
    assert_eq!(s.api_key.as_deref(), Some("env-key"), "LLAMA_API_KEY");
    assert_eq!(s.slots, Some(false), "LLAMA_ARG_NO_* is the negative");
    assert_eq!(src.source_of("ctx-size"), Source::Flag);
    assert_eq!(
        src.source_of("temp"),
        Source::Env("LLAMA_ARG_TEMPERATURE".into())
    );
    assert_eq!(src.source_of("top-k"), Source::File(file.clone()));
    assert_eq!(src.source_of("min-p"), Source::Default);
    let notes: Vec<String> = r.notes.iter().map(|n| n.to_string()).collect();
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("environment LLAMA_ARG_CONT_BATCHING: ignored")),
        "{notes:?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("environment HF_TOKEN: ignored")),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|n| n.starts_with("-ngl 99: ignored")),
        "{notes:?}"
    );
    // --explain: every key with where it came from; the key redacted.
    let x = src.explain();
    assert!(x.contains("ctx-size: 4096  # flag\n"), "{x}");
    assert!(
        x.contains("temp: 0.2  # env LLAMA_ARG_TEMPERATURE\n"),
        "{x}"
    );
    assert!(
        x.contains(&format!("top-k: 5  # file {}\n", file.display())),
        "{x}"
    );
    assert!(x.contains("# min-p: "), "{x}");
    assert!(
        x.contains("api-key: \"<redacted>\"  # env LLAMA_API_KEY"),
        "{x}"
    );
    assert!(!x.contains("env-key"), "{x}");
    // A bad value from the environment names the variable.
    let bad: BTreeMap<&str, &str> = BTreeMap::from([("LLAMA_ARG_CTX_SIZE", "lots")]);
    let get = |k: &str| bad.get(k).map(|v| v.to_string());
    let e = Sources::gather(None, &get, Settings::default(), Rewritten::default()).unwrap_err();
    assert!(e.to_string().contains("LLAMA_ARG_CTX_SIZE"), "{e}");
    let refused: BTreeMap<&str, &str> = BTreeMap::from([("LLAMA_ARG_HF_REPO", "a/b")]);
    let get = |k: &str| refused.get(k).map(|v| v.to_string());
    let e = Sources::gather(None, &get, Settings::default(), Rewritten::default()).unwrap_err();
    assert!(
        e.to_string().contains("LLAMA_ARG_HF_REPO") && e.to_string().contains("downloads"),
        "{e}"
    );
}

#[test]
fn api_keys_from_a_comma_list_and_a_file() {
    let keys = tmp("keys.txt");
    std::fs::write(&keys, "# ops keys\nfile-key-1\n\nfile-key-2\n").unwrap();
    let s = Settings {
        api_key: Some("a, b,,c".into()),
        api_key_file: Some(keys),
        ..Default::default()
    };
    assert_eq!(
        s.api_keys().unwrap(),
        ["a", "b", "c", "file-key-1", "file-key-2"]
    );
    let s = Settings {
        api_key_file: Some("/no/such/keys".into()),
        ..Default::default()
    };
    assert!(s
        .api_keys()
        .unwrap_err()
        .to_string()
        .contains("/no/such/keys"));
}

/// `--image-min-tokens` / `--image-max-tokens` are llama-server's (flag, LLAMA_ARG_* variable,
/// YAML key) and reach the planner's shape; 0 or less keeps the projector's own, as in
/// llama.cpp.
#[test]
fn image_token_limits_from_every_source() {
    let s = flags(&["--image-max-tokens", "256", "--image-min-tokens", "0"]);
    assert_eq!(
        (s.image_min_tokens, s.image_max_tokens),
        (Some(0), Some(256))
    );
    let shape = s.shape();
    assert_eq!(
        (shape.image_min_tokens, shape.image_max_tokens),
        (None, Some(256))
    );
    let env: BTreeMap<&str, &str> = BTreeMap::from([("LLAMA_ARG_IMAGE_MIN_TOKENS", "64")]);
    let get = |k: &str| env.get(k).map(|v| v.to_string());
    let (f, rw) = flags_and_rewrite(&["--image-max-tokens", "-1"]);
    let src = Sources::gather(None, &get, f, rw).unwrap();
    let r = src.resolve().unwrap();
    assert_eq!(r.settings.image_token_limits(), (Some(64), None));
    assert!(r.notes.is_empty(), "{:?}", r.notes);
    let s = parse("image-max-tokens: 1024\nimage-min-tokens: 1024\n").unwrap();
    assert_eq!(s.image_token_limits(), (Some(1024), Some(1024)));
    // A maximum under a minimum from another source is refused naming where it came from.
    let env: BTreeMap<&str, &str> = BTreeMap::from([("LLAMA_ARG_IMAGE_MIN_TOKENS", "512")]);
    let get = |k: &str| env.get(k).map(|v| v.to_string());
    let (f, rw) = flags_and_rewrite(&["--image-max-tokens", "100"]);
    let e = Sources::gather(None, &get, f, rw)
        .unwrap()
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--image-max-tokens") && e.contains("100") && e.contains("512"),
        "{e}"
    );
}

/// `--spec-adaptive false` (or `spec-adaptive: false` in the file) drafts n-max every step, as
/// llama.cpp does; the default adapts each slot's depth.
#[test]
fn spec_adaptive_turns_the_adaptive_draft_depth_off() {
    for (s, want) in [
        (flags(&["--spec-type", "draft-mtp"]), true),
        (
            flags(&["--spec-type", "draft-mtp", "--spec-adaptive", "false"]),
            false,
        ),
        (
            flags(&["--spec-type", "draft-mtp", "--spec-adaptive"]),
            true,
        ),
        (
            parse("spec-type: draft-mtp\nspec-adaptive: false\n").unwrap(),
            false,
        ),
    ] {
        let cfg = tern::plan::boot::engine_config(&s.shape(), &s);
        assert_eq!(cfg.spec.map(|c| c.adaptive), Some(want), "{s:?}");
    }
    assert!(matches!(
        parse("spec-adaptive: maybe\n"),
        Err(e) if e.to_string().contains("spec-adaptive")
    ));
}
