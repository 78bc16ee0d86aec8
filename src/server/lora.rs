//! LoRA adapters over HTTP, as llama-server serves them: `GET /lora-adapters` lists the loaded
//! adapters with their global scales, `POST /lora-adapters` sets those scales (an adapter the
//! list leaves out goes to 0), and a request's own `lora: [{id, scale}]` list replaces them for
//! that request (again, unlisted adapters at 0). A request without the field, or with an empty
//! list, takes the global scales. Each sequence carries its scales into the batch, so requests
//! at different scales still share a decode step.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::request::{field, type_name, Obj};
use super::state::AppState;

/// One loaded adapter as the API shows it.
#[derive(Clone, Debug)]
pub struct LoadedAdapter {
    pub path: PathBuf,
    pub task_name: String,
    pub prompt_prefix: String,
}

/// The adapters and their global scales.
#[derive(Debug, Default)]
pub struct LoraState {
    pub adapters: Vec<LoadedAdapter>,
    scales: RwLock<Vec<f32>>,
}

impl LoraState {
    /// `scales` are the boot scales (`--lora` 1, `--lora-scaled` its own; every one 0 with
    /// `--lora-init-without-apply`).
    pub fn new(adapters: Vec<LoadedAdapter>, scales: Vec<f32>) -> LoraState {
        LoraState {
            adapters,
            scales: RwLock::new(scales),
        }
    }

    pub fn global(&self) -> Vec<f32> {
        self.scales
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The scales a request runs with.
    pub fn for_request(&self, body: &Obj) -> Result<Vec<f32>, ApiError> {
        match field(body, "lora") {
            None => Ok(self.global()),
            Some(Value::Array(list)) if list.is_empty() => Ok(self.global()),
            Some(v) => self.parse_list(v, "lora"),
        }
    }

    /// A `[{id, scale}]` list as one scale per adapter, unlisted ones 0 (llama-server's
    /// `construct_lora_list`). An id that names no adapter is refused rather than ignored.
    fn parse_list(&self, v: &Value, what: &str) -> Result<Vec<f32>, ApiError> {
        let Value::Array(list) = v else {
            return Err(ApiError::bad_request(format!(
                "'{what}' must be an array of objects with 'id' and 'scale' fields, not {}",
                type_name(v)
            )));
        };
        let n = self.adapters.len();
        let mut out = vec![0.0; n];
        for (i, e) in list.iter().enumerate() {
            let Value::Object(e) = e else {
                return Err(ApiError::bad_request(format!(
                    "'{what}[{i}]' must be an object with 'id' and 'scale', not {}",
                    type_name(e)
                )));
            };
            let id = match e.get("id") {
                Some(Value::Number(x)) => x.as_u64(),
                _ => None,
            }
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "'{what}[{i}].id' must be a non-negative integer (an id from GET /lora-adapters)"
                ))
            })?;
            if id as usize >= n {
                return Err(ApiError::bad_request(format!(
                    "'{what}[{i}].id' is {id}, but {n} LoRA adapter{} loaded",
                    if n == 1 { " is" } else { "s are" }
                )));
            }
            // A missing scale is 0, as llama-server reads it.
            let scale = match e.get("scale") {
                None | Some(Value::Null) => 0.0,
                Some(Value::Number(x)) => x.as_f64().unwrap_or(f64::NAN) as f32,
                Some(other) => {
                    return Err(ApiError::bad_request(format!(
                        "'{what}[{i}].scale' must be a number, not {}",
                        type_name(other)
                    )))
                }
            };
            if !scale.is_finite() {
                return Err(ApiError::bad_request(format!(
                    "'{what}[{i}].scale' must be a finite number"
                )));
            }
            out[id as usize] = scale;
        }
        Ok(out)
    }

    /// As the request's `lora` field and `/slots` show them.
    pub fn to_json(scales: &[f32]) -> Value {
        Value::Array(
            scales
                .iter()
                .enumerate()
                .map(|(id, s)| json!({"id": id, "scale": s}))
                .collect(),
        )
    }
}

pub async fn get_adapters(State(state): State<Arc<AppState>>) -> Json<Value> {
    let l = &state.lora;
    let scales = l.global();
    Json(Value::Array(
        l.adapters
            .iter()
            .zip(scales)
            .enumerate()
            .map(|(id, (a, s))| {
                json!({"id": id, "path": a.path.display().to_string(), "scale": s,
                       "task_name": a.task_name, "prompt_prefix": a.prompt_prefix})
            })
            .collect(),
    ))
}

pub async fn post_adapters(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    if !v.is_array() {
        return Err(ApiError::bad_request("Request body must be an array"));
    }
    let scales = state.lora.parse_list(&v, "body")?;
    *state.lora.scales.write().unwrap_or_else(|e| e.into_inner()) = scales;
    Ok(Json(json!({"success": true})))
}
