//! Each tool's arguments, checked before anything is charged and answered in canonical form
//! (every default filled in), so the same call is the same to loop detection.

use super::declared;

use rmcp::model::JsonObject;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::guard::Refusal;

/// Longest prompt accepted, in characters.
pub const MAX_PROMPT_CHARS: usize = 4000;
const MAX_TITLE_CHARS: usize = 200;
const MAX_BODY_CHARS: usize = 100_000;
const MAX_URL_CHARS: usize = 2048;
/// Arguments checked before any budget is charged.
pub(super) trait Validate {
    /// Ok, or what is wrong in words an agent can fix.
    fn validate(&self) -> Result<(), String>;
}

fn at_most(field: &str, value: &str, max: usize) -> Result<(), String> {
    let n = value.chars().count();
    if n > max { Err(format!("`{field}` is {n} characters long; the limit is {max}")) } else { Ok(()) }
}

fn not_blank(field: &str, value: &str) -> Result<(), String> {
    if value.trim().is_empty() { Err(format!("`{field}` must not be empty")) } else { Ok(()) }
}

/// Parses and checks `args`, answering them in canonical form: every default filled in, so
/// `{}` and `{"limit": 10}` are the same call to loop detection.
pub(super) fn parse<T: DeserializeOwned + Serialize + Validate>(
    args: Option<&JsonObject>,
) -> Result<serde_json::Value, String> {
    let value = serde_json::Value::Object(args.cloned().unwrap_or_default());
    let parsed: T = serde_json::from_value(value).map_err(|e| e.to_string())?;
    parsed.validate()?;
    serde_json::to_value(&parsed).map_err(|e| e.to_string())
}

/// Checks `args` against the tool's schema and size limits, before anything is charged, and
/// answers them in canonical form.
pub fn validate_arguments(tool: &str, args: Option<&JsonObject>) -> Result<serde_json::Value, Refusal> {
    let checked = match declared(tool) {
        Some(declared) => (declared.check)(args),
        None => Err("unknown tool".to_owned()),
    };
    checked.map_err(|problem| Refusal::invalid_arguments(tool, &problem))
}

/// `list_articles` arguments. Every field is optional.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArticlesArgs {
    /// Words to look for in article titles (empty: all articles).
    #[serde(default)]
    #[schemars(length(max = 200))]
    pub query: String,
    /// How many articles to return (1-50).
    #[serde(default = "default_page_size")]
    #[schemars(range(min = 1, max = 50))]
    pub limit: u32,
    /// The `next_cursor` of the previous page, to read the next one (empty: first page).
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub cursor: String,
}

fn default_page_size() -> u32 {
    10
}

impl Validate for ListArticlesArgs {
    fn validate(&self) -> Result<(), String> {
        at_most("query", &self.query, 200)?;
        at_most("cursor", &self.cursor, 64)?;
        if (1..=50).contains(&self.limit) {
            Ok(())
        } else {
            Err(format!("`limit` must be between 1 and 50 (got {})", self.limit))
        }
    }
}

/// `save_article` arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SaveArticleArgs {
    /// Headline (at most 200 characters).
    #[schemars(length(min = 1, max = 200))]
    pub title: String,
    /// Full text (at most 100000 characters).
    #[schemars(length(min = 1, max = 100000))]
    pub body: String,
}

impl Validate for SaveArticleArgs {
    fn validate(&self) -> Result<(), String> {
        not_blank("title", &self.title)?;
        not_blank("body", &self.body)?;
        at_most("title", &self.title, MAX_TITLE_CHARS)?;
        at_most("body", &self.body, MAX_BODY_CHARS)
    }
}

/// `generate_image` arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateImageArgs {
    /// What to draw (at most 4000 characters).
    #[schemars(length(min = 1, max = 4000))]
    pub prompt: String,
}

impl Validate for GenerateImageArgs {
    fn validate(&self) -> Result<(), String> {
        not_blank("prompt", &self.prompt)?;
        at_most("prompt", &self.prompt, MAX_PROMPT_CHARS)
    }
}

/// `generate_image_to_video` arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateVideoArgs {
    /// The http(s) URL of the first frame.
    #[schemars(length(min = 1, max = 2048))]
    pub image_url: String,
    /// How the scene should move (at most 4000 characters).
    #[schemars(length(min = 1, max = 4000))]
    pub prompt: String,
    /// The clip's length in seconds (1-30; the price follows it).
    #[serde(default = "default_video_seconds")]
    #[schemars(range(min = 1, max = 30))]
    pub seconds: u32,
}

fn default_video_seconds() -> u32 {
    crate::upstream::api::DEFAULT_VIDEO_SECONDS
}

/// The longest clip a video job may ask for.
const MAX_VIDEO_SECONDS: u32 = 30;

impl Validate for GenerateVideoArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_VIDEO_SECONDS).contains(&self.seconds) {
            return Err(format!("`seconds` must be between 1 and {MAX_VIDEO_SECONDS} (got {})", self.seconds));
        }
        not_blank("prompt", &self.prompt)?;
        at_most("prompt", &self.prompt, MAX_PROMPT_CHARS)?;
        at_most("image_url", &self.image_url, MAX_URL_CHARS)?;
        match reqwest::Url::parse(&self.image_url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => Ok(()),
            _ => Err("`image_url` must be an http or https URL".to_owned()),
        }
    }
}

/// `get_prediction` and `cancel_prediction` arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PredictionArgs {
    /// The `predict_id` returned by generate_image or generate_image_to_video.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub predict_id: String,
}

impl Validate for PredictionArgs {
    fn validate(&self) -> Result<(), String> {
        let ok = !self.predict_id.is_empty()
            && self.predict_id.len() <= 64
            && self.predict_id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if ok { Ok(()) } else { Err("`predict_id` must be 1-64 characters of A-Z, a-z, 0-9, _ or -".to_owned()) }
    }
}

/// No arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

impl Validate for NoArgs {
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}
