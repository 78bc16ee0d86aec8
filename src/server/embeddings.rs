//! `POST /v1/embeddings` (OpenAI's shape) and `/embedding` (llama-server's), served when the
//! server runs with `--embeddings`: each input runs on a slot, its rows (the hidden state after
//! the output norm) pooled by `--pooling` and normalized as llama-server does
//! (`embd_normalize`, default 2: L2).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Value};

use super::error::ApiError;
use super::generate::{check_prompt, submit, tokenize};
use super::request::{field, opt_i64, opt_str, parse_object, prompt_value, type_name, Prompt};
use super::state::AppState;
use super::Body as RawBody;
use crate::runtime::engine::{Event, Pooling, Request};

/// `POST /v1/embeddings`.
pub async fn embeddings_oai(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    match embeddings_impl(state, body.0, body.1, true).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// `POST /embedding` (and `/embeddings`): llama-server's own shape.
pub async fn embedding_native(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    match embeddings_impl(state, body.0, body.1, false).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// llama.cpp's `common_embd_normalize`: -1 none, 0 max-abs scaled to int16, 2 L2, else the
/// p-norm.
pub fn normalize(v: &mut [f32], p: i64) {
    let sum: f64 = match p {
        -1 => 1.0,
        0 => v.iter().map(|x| x.abs() as f64).fold(0.0, f64::max) / 32760.0,
        2 => v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt(),
        p => v
            .iter()
            .map(|x| (x.abs() as f64).powi(p as i32))
            .sum::<f64>()
            .powf(1.0 / p as f64),
    };
    let norm = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    v.iter_mut().for_each(|x| *x *= norm);
}

/// An embedding request parsed and tokenized (off the async runtime).
struct PreparedEmbeddings {
    ids_all: Vec<Vec<u32>>,
    oai: bool,
    use_base64: bool,
    embd_normalize: i64,
    model: Option<String>,
}

fn prepare_embeddings(
    state: &AppState,
    bytes: &[u8],
    mut oai: bool,
) -> Result<PreparedEmbeddings, ApiError> {
    let body = parse_object(bytes)?;
    let (key, input) = match (field(&body, "input"), field(&body, "content")) {
        (Some(v), _) => ("input", v),
        (None, Some(v)) => {
            // "content" is llama-server's field, answered in its own shape.
            oai = false;
            ("content", v)
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "\"input\" or \"content\" must be provided",
            ))
        }
    };
    let use_base64 = match opt_str(&body, "encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(_) => {
            return Err(ApiError::bad_request(
                "The format to return the embeddings in. Can be either float or base64",
            ))
        }
    };
    let embd_normalize = opt_i64(&body, "embd_normalize")?.unwrap_or(2);
    if embd_normalize < -1 {
        return Err(ApiError::bad_request(format!(
            "'embd_normalize' = {embd_normalize} must be -1 (none), 0 (max-abs), 1, 2 (L2) or a higher p"
        )));
    }
    // One prompt (a string or token ids) or a list of them.
    let prompts: Vec<Prompt> = match input {
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::bad_request(format!("'{key}' must not be empty")))
        }
        Value::Array(a) if !a.iter().any(Value::is_number) => a
            .iter()
            .enumerate()
            .map(|(i, v)| prompt_value(v, &format!("{key}[{i}]")))
            .collect::<Result<_, _>>()?,
        Value::Array(_) | Value::String(_) => vec![prompt_value(input, key)?],
        v => {
            return Err(ApiError::bad_request(format!(
                "'{key}' must be a string, an array of strings or of token ids, not {}",
                type_name(v)
            )))
        }
    };
    let mut ids_all = Vec::with_capacity(prompts.len());
    for p in prompts {
        let ids = match p {
            Prompt::Text(t) => tokenize(state, &t)?,
            Prompt::Tokens(ids) => ids,
        };
        if ids.is_empty() {
            return Err(ApiError::bad_request("Input content cannot be empty"));
        }
        check_prompt(state, &ids)?;
        ids_all.push(ids);
    }
    let model = opt_str(&body, "model")?.map(str::to_string);
    Ok(PreparedEmbeddings {
        ids_all,
        oai,
        use_base64,
        embd_normalize,
        model,
    })
}

async fn embeddings_impl(
    state: Arc<AppState>,
    bytes: axum::body::Bytes,
    access: super::Access,
    oai: bool,
) -> Result<Response, ApiError> {
    let Some(pooling) = state.cfg.embeddings else {
        return Err(ApiError::not_supported(
            "This server does not support embeddings. Start it with `--embeddings`",
        ));
    };
    if oai && pooling == Pooling::None {
        return Err(ApiError::bad_request(
            "Pooling type 'none' is not OAI compatible. Please use a different pooling type",
        ));
    }
    let PreparedEmbeddings {
        ids_all,
        oai,
        use_base64,
        embd_normalize,
        model,
    } = super::limits::off_runtime(&state, move |st| prepare_embeddings(st, &bytes, oai)).await?;
    // Every input is queued at once: the engine runs them on as many slots as are free.
    // Embeddings take the global adapter scales (llama-server reads no `lora` field here).
    let lora = state.lora.global();
    let mut subs = Vec::with_capacity(ids_all.len());
    for ids in ids_all {
        let n = ids.len();
        let req = Request {
            prompt: ids,
            max_tokens: 0,
            embed: Some(pooling),
            lora: lora.clone(),
            ..Default::default()
        };
        subs.push((n, submit(&state, req, json!({}), access.clone()).await?));
    }
    let mut results = Vec::with_capacity(subs.len());
    for (index, (n_tokens, mut sub)) in subs.into_iter().enumerate() {
        let mut rows = None;
        loop {
            match sub.rx.recv().await {
                Some(Event::Embedding(r)) => rows = Some(r),
                Some(Event::Done(_)) => break,
                Some(Event::Error(e)) => return Err(e.into()),
                Some(_) => {}
                None => return Err(ApiError::unavailable("the engine stopped")),
            }
        }
        let mut rows =
            rows.ok_or_else(|| ApiError::server("the engine ended without an embedding"))?;
        // llama-server normalizes pooled embeddings only.
        if pooling != Pooling::None {
            rows.iter_mut().for_each(|r| normalize(r, embd_normalize));
        }
        results.push((index, n_tokens, rows));
    }
    access.tokens(results.iter().map(|r| r.1).sum(), 0, 0);
    if !oai {
        let out: Vec<Value> = results
            .into_iter()
            .map(|(index, _, rows)| json!({ "index": index, "embedding": rows }))
            .collect();
        return Ok(Json(Value::Array(out)).into_response());
    }
    let mut n_total = 0;
    let data: Vec<Value> = results
        .into_iter()
        .map(|(index, n, mut rows)| {
            n_total += n;
            let v = rows.swap_remove(0);
            if use_base64 {
                let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!({
                    "embedding": base64::engine::general_purpose::STANDARD.encode(raw),
                    "index": index,
                    "object": "embedding",
                    "encoding_format": "base64",
                })
            } else {
                json!({ "embedding": v, "index": index, "object": "embedding" })
            }
        })
        .collect();
    let model = model.unwrap_or_else(|| state.cfg.alias.clone());
    Ok(Json(json!({
        "model": model,
        "object": "list",
        "usage": { "prompt_tokens": n_total, "total_tokens": n_total },
        "data": data,
    }))
    .into_response())
}
