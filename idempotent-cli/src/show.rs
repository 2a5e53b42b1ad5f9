//! How records are printed: text for people, JSON for scripts.

use std::fmt::Write as _;
use std::time::Duration;

use idempotent_runtime::admin::{Entry, Page, Released, State, Stats};
use idempotent_runtime::http::LayerRecord;
use serde_json::{Value, json};

/// `1h2m`, `4m10s`, `41.2s`, `350ms`.
pub fn duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 3600 {
        format!("{}h{}m", secs / 3600, secs % 3600 / 60)
    } else if secs >= 60 {
        format!("{}m{}s", secs / 60, secs % 60)
    } else if secs >= 1 {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        format!("{}ms", d.as_millis())
    }
}

fn millis(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
}

/// An entry as JSON (the outcome parsed when it is JSON, else as text).
pub fn entry_json(entry: &Entry) -> Value {
    let outcome = entry.outcome.as_ref().map_or(Value::Null, |bytes| {
        serde_json::from_slice(bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
    });
    json!({
        "key": entry.user_key(),
        "scope": entry.scope(),
        "state": entry.state.as_str(),
        "token": entry.token,
        "fingerprint": entry.fingerprint,
        "remaining_ms": millis(entry.remaining),
        "outcome": outcome,
        "layer_record": entry.outcome.as_deref().and_then(LayerRecord::from_outcome).map(|r| layer_record_json(&r)),
    })
}

/// A record of the HTTP or gRPC layer as JSON: header values as text, a body as text when it is
/// UTF-8 (`body`) and in hex otherwise (`body_hex`).
fn layer_record_json(record: &LayerRecord) -> Value {
    let headers = |list: &[(String, Vec<u8>)]| -> Value {
        list.iter().map(|(name, value)| json!([name, String::from_utf8_lossy(value)])).collect()
    };
    let with_body = |mut value: Value, bytes: &[u8]| {
        if let Ok(text) = std::str::from_utf8(bytes) {
            value["body"] = json!(text);
        } else {
            let hex = bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut hex, b| {
                let _ = write!(hex, "{b:02x}");
                hex
            });
            value["body_hex"] = json!(hex);
        }
        value
    };
    match record {
        LayerRecord::Response { status, headers: list, body } => {
            with_body(json!({ "kind": "http_response", "status": status, "headers": headers(list) }), body)
        }
        LayerRecord::Answer { headers: list, body, trailers } => with_body(
            json!({ "kind": "grpc_answer", "headers": headers(list), "trailers": trailers.as_deref().map(headers) }),
            body,
        ),
        LayerRecord::TooLarge { limit } => json!({ "kind": "too_large", "limit": limit }),
        LayerRecord::Failed { reason } => json!({ "kind": "failed", "reason": reason }),
        _ => Value::Null,
    }
}

/// An entry for people: one field a line, then the outcome.
pub fn entry_text(entry: &Entry) -> String {
    let mut out = String::new();
    let left = match entry.state {
        State::Running => "lease left",
        State::Done => "retention left",
        _ => "left",
    };
    let _ = writeln!(out, "scope        {}", entry.scope());
    let _ = writeln!(out, "key          {}", entry.user_key());
    let _ = writeln!(out, "state        {}", entry.state);
    let _ = writeln!(out, "owner token  {}", entry.token);
    let _ = writeln!(out, "{left:<13}{}", entry.remaining.map_or_else(|| "-".to_owned(), duration));
    let _ = writeln!(out, "fingerprint  {}", entry.fingerprint.as_deref().unwrap_or("-"));
    if let Some(outcome) = &entry.outcome {
        let _ = writeln!(out, "outcome:");
        for line in outcome_text(outcome).lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}

/// A recorded outcome: a record of the HTTP or gRPC layer as status, headers and body; other JSON
/// pretty-printed.
pub fn outcome_text(outcome: &[u8]) -> String {
    if let Some(record) = LayerRecord::from_outcome(outcome) {
        return layer_record_text(&record, outcome);
    }
    let Ok(value) = serde_json::from_slice::<Value>(outcome) else {
        return String::from_utf8_lossy(outcome).into_owned();
    };
    if let Some(response) = value.pointer("/Ok/Response") {
        return response_text(response);
    }
    serde_json::to_string_pretty(&value).unwrap_or_default()
}

/// A record of the layers' compact form.
fn layer_record_text(record: &LayerRecord, outcome: &[u8]) -> String {
    let headers = |out: &mut String, headers: &[(String, Vec<u8>)]| {
        for (name, value) in headers {
            let _ = writeln!(out, "{name}: {}", String::from_utf8_lossy(value));
        }
    };
    let mut out = String::new();
    match record {
        LayerRecord::Response { status, headers: list, body } => {
            let _ = writeln!(out, "HTTP {status}");
            headers(&mut out, list);
            out.push('\n');
            out.push_str(&body_text(body));
        }
        LayerRecord::Answer { headers: list, body, trailers } => {
            out.push_str("gRPC answer\n");
            headers(&mut out, list);
            let _ = writeln!(out, "\n{}", body_text(body));
            if let Some(trailers) = trailers {
                out.push_str("\ntrailers:\n");
                headers(&mut out, trailers);
            }
        }
        LayerRecord::TooLarge { limit } => {
            let _ = writeln!(
                out,
                "the handler ran; its response was over the {limit}-byte recording limit, so retries get an error \
                 and nothing runs again"
            );
            let _ = write!(out, "stored: {}", String::from_utf8_lossy(outcome));
        }
        LayerRecord::Failed { reason } => {
            let _ = writeln!(
                out,
                "the handler ran; its response failed while it was sent ({reason}), so retries get an error and \
                 nothing runs again"
            );
            let _ = write!(out, "stored: {}", String::from_utf8_lossy(outcome));
        }
        _ => out.push_str(&String::from_utf8_lossy(outcome)),
    }
    out
}

/// A body: JSON indented, other text as it is, bytes in hex (the first 64).
fn body_text(body: &[u8]) -> String {
    match std::str::from_utf8(body) {
        Ok(text) if !text.contains(|c: char| c.is_control() && c != '\n' && c != '\t' && c != '\r') => {
            match serde_json::from_str::<Value>(text) {
                Ok(json) if json.is_object() || json.is_array() => {
                    serde_json::to_string_pretty(&json).unwrap_or_else(|_| text.to_owned())
                }
                _ => text.to_owned(),
            }
        }
        _ => {
            let mut out = format!("<{} bytes>", body.len());
            for byte in body.iter().take(64) {
                let _ = write!(out, " {byte:02x}");
            }
            if body.len() > 64 {
                out.push_str(" ...");
            }
            out
        }
    }
}

/// The HTTP layer's recorded response in its earlier form: `{"status": 201, "headers": [[name,
/// data]...], "body": data}` where data is `{"Text": ...}` or `{"Base64": ...}`.
fn response_text(response: &Value) -> String {
    let data = |value: &Value| match (value.get("Text"), value.get("Base64")) {
        (Some(Value::String(text)), _) => text.clone(),
        (_, Some(Value::String(b64))) => format!("<{} bytes of base64> {b64}", b64.len()),
        _ => value.to_string(),
    };
    let mut out = format!("HTTP {}\n", response.get("status").unwrap_or(&Value::Null));
    for header in response.get("headers").and_then(Value::as_array).into_iter().flatten() {
        if let Some([name, value]) = header.as_array().map(Vec::as_slice) {
            let _ = writeln!(out, "{}: {}", name.as_str().unwrap_or("?"), data(value));
        }
    }
    out.push('\n');
    let body = response.get("body").map(data).unwrap_or_default();
    // A JSON body is shown indented.
    match serde_json::from_str::<Value>(&body) {
        Ok(json) if json.is_object() || json.is_array() => {
            out.push_str(&serde_json::to_string_pretty(&json).unwrap_or(body));
        }
        _ => out.push_str(&body),
    }
    out
}

/// A page as a table.
pub fn page_text(page: &Page, header: bool) -> String {
    let mut out = String::new();
    if header {
        let _ = writeln!(out, "{:<8} {:>9}  {:<20} {:<32}  KEY", "STATE", "LEFT", "SCOPE", "TOKEN");
    }
    for e in &page.entries {
        let left = e.remaining.map_or_else(|| "-".to_owned(), duration);
        let _ =
            writeln!(out, "{:<8} {:>9}  {:<20} {:<32}  {}", e.state.as_str(), left, e.scope(), e.token, e.user_key());
    }
    out
}

/// A page as JSON.
pub fn page_json(page: &Page) -> Value {
    json!({ "entries": page.entries.iter().map(entry_json).collect::<Vec<_>>(), "next": page.next })
}

/// Stats for people.
pub fn stats_text(stats: &Stats) -> String {
    let mut out = format!("{:<20} {:<8} {:>10}\n", "SCOPE", "STATE", "COUNT");
    for c in &stats.counts {
        let _ = writeln!(out, "{:<20} {:<8} {:>10}", c.scope, c.state.as_str(), c.count);
    }
    match &stats.next_to_expire {
        Some((key, left)) => {
            let _ = writeln!(out, "running claim closest to its end: {key} ({} left)", duration(*left));
        }
        None => out.push_str("no running claims\n"),
    }
    out
}

/// Stats as JSON.
pub fn stats_json(stats: &Stats) -> Value {
    json!({
        "counts": stats.counts.iter().map(|c| json!({"scope": c.scope, "state": c.state.as_str(), "count": c.count})).collect::<Vec<_>>(),
        "next_to_expire": stats.next_to_expire.as_ref().map(|(key, left)| json!({"key": key, "remaining_ms": millis(Some(*left))})),
    })
}

/// What a release did, as JSON.
pub fn released_json(seen: &Entry, released: Released) -> Value {
    json!({ "released": released == Released::Deleted, "was": entry_json(seen) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_http_outcomes_show_status_headers_and_body() {
        let recorded = br#"{"Ok":{"Response":{"status":201,"headers":[["content-type",{"Text":"application/json"}]],"body":{"Text":"{\"id\":7}"}}}}"#;
        let text = outcome_text(recorded);
        assert!(text.starts_with("HTTP 201\ncontent-type: application/json\n\n{\n  \"id\": 7\n}"), "{text}");
        assert_eq!(outcome_text(br#"{"Ok":3}"#), "{\n  \"Ok\": 3\n}");
        assert_eq!(outcome_text(b"\xffraw"), "\u{fffd}raw");
    }

    #[test]
    fn cli_layer_records_of_the_compact_form_show_as_responses() {
        let http = br#"{"Ok":"h20112:content-type16:application/json8:location4:/o/1:{\"id\":7}"}"#;
        let text = outcome_text(http);
        assert_eq!(text, "HTTP 201\ncontent-type: application/json\nlocation: /o/1\n\n{\n  \"id\": 7\n}", "{text}");
        let grpc =
            br#"{"Ok":"a12:content-type16:application/grpct11:grpc-status1:0:\u0000\u0000\u0000\u0000\u0002\b\u0001"}"#;
        let text = outcome_text(grpc);
        assert_eq!(
            text,
            "gRPC answer\ncontent-type: application/grpc\n\n<7 bytes> 00 00 00 00 02 08 01\n\ntrailers:\ngrpc-status: 0\n",
            "{text}"
        );
        let text = outcome_text(br#"{"Ok":"l2048"}"#);
        assert!(
            text.contains("over the 2048-byte recording limit") && text.ends_with(r#"stored: {"Ok":"l2048"}"#),
            "{text}"
        );
        let text = outcome_text(br#"{"Ok":"fthe stream broke"}"#);
        assert!(text.contains("failed while it was sent (the stream broke)"), "{text}");
        // As JSON, for scripts.
        let shown = |outcome: &[u8]| {
            LayerRecord::from_outcome(outcome).map(|record| layer_record_json(&record)).unwrap_or_default()
        };
        assert_eq!(
            shown(http),
            json!({"kind": "http_response", "status": 201, "body": r#"{"id":7}"#,
                   "headers": [["content-type", "application/json"], ["location", "/o/1"]]})
        );
        assert_eq!(
            shown(grpc),
            json!({"kind": "grpc_answer", "headers": [["content-type", "application/grpc"]],
                   "body": "\u{0}\u{0}\u{0}\u{0}\u{2}\u{8}\u{1}", "trailers": [["grpc-status", "0"]]})
        );
        assert_eq!(
            shown(br#"{"Ok":"a;/w=="}"#),
            json!({"kind": "grpc_answer", "headers": [], "trailers": null, "body_hex": "ff"})
        );
        assert_eq!(shown(br#"{"Ok":"l2048"}"#), json!({"kind": "too_large", "limit": 2048}));
        assert_eq!(shown(br#"{"Ok":3}"#), Value::Null);
    }

    #[test]
    fn cli_durations_are_short() {
        assert_eq!(duration(Duration::from_millis(350)), "350ms");
        assert_eq!(duration(Duration::from_millis(41_200)), "41.2s");
        assert_eq!(duration(Duration::from_secs(250)), "4m10s");
        assert_eq!(duration(Duration::from_secs(3720)), "1h2m");
    }
}
