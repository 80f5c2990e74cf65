use crate::upstream::classes::{IMAGE, VIDEO};

use super::*;

#[test]
fn each_declaration_lists_its_own_method_under_its_name_once() {
    let mut listed: Vec<String> = listed().iter().map(|t| t.name.to_string()).collect();
    listed.sort();
    let mut declared: Vec<&str> = TOOLS.iter().map(|d| d.name).collect();
    declared.sort();
    assert_eq!(listed, declared, "one tool per declaration, none twice");
    for tool in TOOLS {
        assert_eq!((tool.tool)().name, tool.name, "the declaration of {} lists another method", tool.name);
    }
}

#[test]
fn the_catalogue_reads_what_each_tool_reaches_from_its_declaration() {
    let catalogue = catalogue();
    for (tool, job, callers_own) in [
        ("list_articles", false, false),
        ("save_article", false, false),
        ("generate_image", true, false),
        ("generate_image_to_video", true, false),
        ("get_prediction", false, true),
        ("cancel_prediction", false, true),
        ("rate_limit_status", false, true),
    ] {
        assert!(catalogue.contains(tool), "{tool}");
        assert_eq!(catalogue.holds_slots(tool), job, "{tool}");
        assert_eq!(starts_job(tool), job, "{tool}");
        assert_eq!(catalogue.answers_for_the_caller(tool), callers_own, "{tool}");
    }
    assert_eq!((job_class("generate_image"), job_class("generate_image_to_video")), (Some(IMAGE), Some(VIDEO)));
    let video = catalogue.arguments_of("generate_image_to_video").expect("known arguments");
    assert!(["image_url", "prompt", "seconds"].iter().all(|a| video.iter().any(|v| v == a)), "{video:?}");
}

#[test]
fn every_routed_tool_is_in_the_catalogue_with_a_validator() {
    let catalogue = catalogue();
    assert_eq!(catalogue.names().count(), 7);
    assert!(catalogue.holds_slots("generate_image") && !catalogue.holds_slots("list_articles"));
    for name in catalogue.names() {
        // Each catalogued tool has a validator (an unknown one would say "unknown tool").
        let r = validate_arguments(name, None);
        assert!(r.as_ref().err().is_none_or(|e| !e.message.contains("unknown tool")), "{name}");
    }
}

#[test]
fn over_long_prompt_is_refused_with_its_length() {
    let args = serde_json::json!({"prompt": "x".repeat(MAX_PROMPT_CHARS + 1)});
    let r = validate_arguments("generate_image", args.as_object()).expect_err("must refuse");
    assert!(r.message.contains("4001") && r.message.contains("4000"), "{}", r.message);
}
